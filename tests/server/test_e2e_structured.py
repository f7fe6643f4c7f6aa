"""End to end: structured outputs on the real server (embedded SmolLM2-135M) with the real
OpenAI SDK. Every finished (``stop``) output validates against its schema with ``jsonschema``
(temperature 0 and 1, several seeds, 10 schemas); regex and choice outputs match; the request
forms (OpenAI, vLLM, llama.cpp) all constrain; bad constraints are 400s naming the problem and
the server serves on afterwards."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.server.helpers import assert_error, sample, scrape

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": {"type": "string", "maxLength": 40}},
        "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": ["S", "M", "L"]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1,
                                                "maximum": 5}}, "required": ["score"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
     "required": ["zip", "code"]},
    # (a bounded integer: an unbounded one lets a greedy tiny model write digits to max_tokens)
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -999,
                                                           "maximum": 999},
                                                          {"type": "boolean"}]}},
     "required": ["value"]},
    {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10},
        "y": {"type": "integer", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                      "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3,
                                                "maxLength": 15},
                                      "note": {"type": "string", "maxLength": 10}},
     "required": ["title"]},  # note optional
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 9}},
        "required": ["sku", "qty"]}}, "ok": {"type": "boolean"}}, "required": ["items", "ok"]},
]


def _chat(schema: dict, **kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "answer", "schema": schema,
                                                 "strict": True}},
                max_tokens=120, **kw)


def test_chat_completions_parse_with_a_pydantic_model(real_server):
    client = real_server.client()
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a big city, as JSON."}],
        response_format=City, temperature=0, max_tokens=120)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City)
    City.model_validate_json(msg.content)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_finished_output_validates(real_server, i):
    client = real_server.client()
    schema = SCHEMAS[i]
    settings = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in (1, 2)]
    finished = 0
    for kw in settings:
        r = client.chat.completions.create(**_chat(schema, **kw))
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
            finished += 1
    assert finished >= 1


def test_json_object_and_streaming(real_server):
    client = real_server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
              response_format={"type": "json_object"}, temperature=0, max_tokens=80)
    full = client.chat.completions.create(**kw)
    content = full.choices[0].message.content
    assert content.startswith("{")
    if full.choices[0].finish_reason == "stop":  # else: max_tokens reached mid-object
        assert isinstance(json.loads(content), dict)
    # Streaming: the deltas add up to a valid object (a short enum schema, so that it ends).
    chunks = list(client.chat.completions.create(stream=True, **_chat(SCHEMAS[3], temperature=0)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[3])


def test_completions_forms_regex_choice_and_grammar(real_server):
    client = real_server.client()
    base = dict(model=MODEL, prompt="The answer is", max_tokens=30)
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": r"(yes|no), because [a-z]{2,8}"}, r"(yes|no), because [a-z]{2,8}"),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, "alpha|beta"),
        ({"guided_choice": ["left", "right", "up"]}, "left|right|up"),
        ({"grammar": 'root ::= "x" [0-9] [0-9]'}, "x[0-9]{2}"),  # llama.cpp GBNF
        ({"structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "!"'}}, "((ab)|(cd))+!"),
    ]
    for extra, pattern in cases:
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=3)):
            r = client.completions.create(extra_body=extra, **base, **kw)
            c = r.choices[0]
            if c.finish_reason == "stop":
                assert re.fullmatch(pattern, c.text), (extra, c.text)
            else:
                assert re.fullmatch(pattern, c.text) is None or c.finish_reason == "length"
    schema = SCHEMAS[3]
    for extra in ({"guided_json": schema}, {"json_schema": schema},
                  {"structured_outputs": {"json": schema}},
                  {"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": schema}}}):
        r = client.completions.create(extra_body=extra, **base | {"max_tokens": 60},
                                      temperature=0)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_max_tokens_mid_object_is_length(real_server):
    r = real_server.client().chat.completions.create(**_chat(SCHEMAS[1], temperature=0) |
                                                    {"max_tokens": 4})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param, contains", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, None, "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": "one"}}}}, None, "number"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"grammar": "root ::= "}}, None, "does not compile"),
    ({"guided_regex": "(ab"}, None, "parenthesis"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 1_000_000}}}},
     "response_format.json_schema.schema", "at most"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "one structured-output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
])
def test_bad_constraints_are_400s_and_the_server_serves_on(real_server, body, param, contains):
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
           **body}
    r = httpx.post(f"{real_server.url}/v1/chat/completions", json=req,
                   headers=real_server.headers, timeout=60)
    assert_error(r, 400, param=param, contains=contains)
    ok = real_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_compiles_and_constrained_rows(real_server):
    client = real_server.client()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["metric", "other"]})
    m = scrape(real_server.url, real_server.headers)
    assert sample(m, "kvserve:structured_output_compile_seconds_count") >= 1
    assert sample(m, "kvserve:structured_output_grammar_cache_hits_total") >= 1
    assert sample(m, "kvserve:structured_output_constrained_rows_total") >= 2


def test_choice_literal_with_the_pydantic_enum_schema(real_server):
    class Verdict(BaseModel):
        verdict: Literal["approve", "reject"]

    r = real_server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Approve or reject?"}],
        response_format=Verdict, temperature=0, max_tokens=40)
    assert r.choices[0].message.parsed.verdict in ("approve", "reject")
