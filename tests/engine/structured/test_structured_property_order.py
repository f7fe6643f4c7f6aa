"""A JSON schema's ``properties`` order survives the spec's canonical form, so an object's fields
are generated in the order the schema (a pydantic model, as instructor and langchain send it)
lists them, as OpenAI's strict mode does. The canonical text once sorted every key, and
``{"name", "country"}`` came out as ``{"country": ..., "name": ...}``: a "reasoning" field put
before "answer" was written after it."""

from __future__ import annotations

import json

import pytest

from engine.params.structured import StructuredSpec
from server.protocol import ChatCompletionRequest

CITY = {"title": "City", "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30},
                       "country": {"type": "string", "maxLength": 30},
                       "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "country", "population"]}


def _property_orders(value, in_properties: bool = False) -> list[list[str]]:
    """The key order of every ``properties`` map, depth first."""
    found = []
    if isinstance(value, dict) and in_properties:  # field name -> schema
        found.append(list(value))
        for v in value.values():
            found += _property_orders(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            found += _property_orders(v, k == "properties")
    elif isinstance(value, list):
        for v in value:
            found += _property_orders(v)
    return found


def test_canonical_schema_keeps_property_order_and_sorts_the_rest():
    schema = {"type": "object", "$defs": {"step": {"type": "object", "properties": {
        "zeta": {"type": "string"}, "alpha": {"type": "integer"}}}},
        "properties": {"reasoning": {"type": "array", "items": {"$ref": "#/$defs/step"}},
                       "answer": {"anyOf": [{"type": "object", "properties": {
                           "b": {"type": "null"}, "a": {"type": "null"}}}, {"type": "null"}]},
                       "properties": {"type": "object", "properties": {  # a field so named
                           "y": {"type": "null"}, "x": {"type": "null"}}}}}
    canon = json.loads(StructuredSpec.json_schema(schema).value)
    assert _property_orders(canon) == _property_orders(schema) == [
        ["zeta", "alpha"], ["reasoning", "answer", "properties"], ["b", "a"], ["y", "x"]]
    assert list(canon) == sorted(schema)  # other keys still sorted: one text per constraint
    assert list(canon["properties"]["answer"]["anyOf"][0]) == ["properties", "type"]
    shuffled = dict(reversed(list(schema.items())))
    assert StructuredSpec.json_schema(shuffled).key == StructuredSpec.json_schema(schema).key
    assert StructuredSpec.json_schema(json.dumps(schema)).key == \
        StructuredSpec.json_schema(schema).key


def test_two_property_orders_are_two_constraints():
    swapped = {**CITY, "properties": dict(reversed(list(CITY["properties"].items())))}
    assert StructuredSpec.json_schema(swapped).key != StructuredSpec.json_schema(CITY).key


def test_a_request_s_schema_reaches_the_spec_in_its_own_order():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": CITY}})
    assert _property_orders(json.loads(body.structured.value)) == [
        ["name", "country", "population"]]


@pytest.mark.parametrize("order", [["name", "country", "population"],
                                   ["population", "country", "name"]])
def test_the_grammar_writes_the_first_listed_field_first(order, tok, backend):
    schema = {**CITY, "properties": {k: CITY["properties"][k] for k in order}}
    m = backend.matcher(backend.compile(StructuredSpec.json_schema(schema)))
    for t in tok.encode('{"', add_special_tokens=False):
        assert m.accept(t)
    first, other = (tok.encode(k[0], add_special_tokens=False)[0] for k in (order[0], order[1]))
    assert m.accept(first)
    m.rollback(1)
    assert not m.accept(other)
