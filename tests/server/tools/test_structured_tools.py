"""Tool-call constraints (server.tools.constraint -> engine.structured ``structural_tag``) on
xgrammar and the tiny byte vocabulary: auto lets text through and constrains the call once its
trigger is written, required forces a call, a named tool_choice forces that function,
parallel_tool_calls false ends the output after one call; the llama3_json format likewise, and
mistral's (kvserve's own tag: a [TOOL_CALLS] array of calls, or v11's name[ARGS]{...})."""

from __future__ import annotations

import json

import pytest

from engine.params.structured import StructuredSpec
from server.tools.constraint import tool_call_spec
from server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11
from server.tools.request import read_tool_set
from tests.support.byte_grammar import EOS, allowed

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
ECHO = {"type": "function", "function": {"name": "echo", "description": "say it", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"]}}}


def matcher(backend, fmt=HERMES, choice=None, parallel=None, tools=(ADD, ECHO)):
    spec = tool_call_spec(fmt, read_tool_set(list(tools), choice, parallel))
    assert spec is not None and spec.kind == "structural_tag"
    return backend.matcher(backend.compile(spec))


def feed(tok, m, text: str) -> bool:
    """Accept ``text`` byte by byte; False at the first refused byte."""
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))


CALL = HERMES.render_call("add", {"a": 1, "b": 2})


def test_auto_lets_text_through_and_constrains_after_the_trigger(tok, backend):
    m = matcher(backend, choice="auto")
    assert EOS in allowed(backend, m)  # an answer with no call may end at once
    assert feed(tok, m, "Let me add that.\n")
    assert EOS in allowed(backend, m)
    assert feed(tok, m, '<tool_call>\n{"name": "')
    assert allowed(backend, m) == set(tok.encode("ae", add_special_tokens=False))  # add | echo
    assert feed(tok, m, 'add", "arguments": {"a": ')
    assert not feed(tok, m, '"')  # an integer, not a string
    m2 = matcher(backend, choice="auto")
    assert feed(tok, m2, "ok " + CALL)
    assert EOS in allowed(backend, m2)
    assert m2.accept(EOS)


def test_required_forces_a_call_and_named_forces_that_function(tok, backend):
    m = matcher(backend, choice="required")
    assert allowed(backend, m) == set(tok.encode("<", add_special_tokens=False))
    assert not feed(tok, m, "Sure")
    assert feed(tok, m, CALL)
    assert EOS in allowed(backend, m)
    named = matcher(backend, choice={"type": "function", "function": {"name": "echo"}})
    assert feed(tok, named, '<tool_call>\n{"name": "')
    assert allowed(backend, named) == set(tok.encode("e", add_special_tokens=False))
    assert feed(tok, named, 'echo", "arguments": {"text": "hi"}}\n</tool_call>')
    assert allowed(backend, named) == {EOS}
    assert not feed(tok, matcher(backend, choice={"type": "function", "function": {
        "name": "echo"}}), CALL)


def test_parallel_false_ends_after_one_call(tok, backend):
    many = matcher(backend, choice="required")
    assert feed(tok, many, CALL + "\n" + CALL)  # parallel calls by default
    one = matcher(backend, choice="required", parallel=False)
    assert feed(tok, one, CALL)
    assert allowed(backend, one) == {EOS}


def test_llama3_json_format(tok, backend):
    m = matcher(backend, fmt=LLAMA3_JSON, choice="required")
    assert not feed(tok, m, "<tool_call>")
    m = matcher(backend, fmt=LLAMA3_JSON, choice="required")
    assert feed(tok, m, json.dumps({"name": "add", "parameters": {"a": 1, "b": 2}}))
    assert EOS in allowed(backend, m)


MISTRAL_CALLS = MISTRAL.render_calls([("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})])


def test_mistral_auto_lets_text_through_and_constrains_the_array(tok, backend):
    m = matcher(backend, fmt=MISTRAL, choice="auto")
    assert EOS in allowed(backend, m)
    assert feed(tok, m, "Let me add that. [TOOL_CALLS] [")
    assert allowed(backend, m) == set(tok.encode("{", add_special_tokens=False))
    assert feed(tok, m, '{"name": "')
    assert allowed(backend, m) == set(tok.encode("ae", add_special_tokens=False))
    assert feed(tok, m, 'add", "arguments": {"a": ')
    assert not feed(tok, m, '"')  # an integer, not a string
    m = matcher(backend, fmt=MISTRAL, choice="auto")
    assert feed(tok, m, "ok " + MISTRAL_CALLS)  # several calls in one array
    assert m.accept(EOS)
    m = matcher(backend, fmt=MISTRAL, choice="auto")
    assert not feed(tok, m, '[TOOL_CALLS][{"name": "echo", "arguments": {"text": "too long!"}}]')


def test_mistral_required_named_and_parallel_false(tok, backend):
    m = matcher(backend, fmt=MISTRAL, choice="required")
    assert allowed(backend, m) == set(tok.encode("[", add_special_tokens=False))
    assert not feed(tok, m, "Sure")
    m = matcher(backend, fmt=MISTRAL, choice="required")
    assert feed(tok, m, MISTRAL_CALLS)
    assert allowed(backend, m) == {EOS}
    named = matcher(backend, fmt=MISTRAL, choice={"type": "function", "function": {"name": "echo"}})
    assert feed(tok, named, '[TOOL_CALLS][{"name": "')
    assert allowed(backend, named) == set(tok.encode("e", add_special_tokens=False))
    assert feed(tok, named, 'echo", "arguments": {"text": "hi"}}')
    assert allowed(backend, named) == set(tok.encode("]", add_special_tokens=False))
    one = matcher(backend, fmt=MISTRAL, choice="auto", parallel=False)
    assert feed(tok, one, 'x [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert allowed(backend, one) == set(tok.encode("]", add_special_tokens=False))
    assert feed(tok, one, "]") and allowed(backend, one) == {EOS}


def test_mistral_v11_form(tok, backend):
    m = matcher(backend, fmt=MISTRAL_V11, choice="required")
    assert feed(tok, m, MISTRAL_V11.render_calls([("add", {"a": 1, "b": 2}),
                                                  ("echo", {"text": "hi"})]))
    assert EOS in allowed(backend, m)
    m = matcher(backend, fmt=MISTRAL_V11, choice="required")
    assert not feed(tok, m, '[TOOL_CALLS]add[ARGS]{"a": "1"')
    named = matcher(backend, fmt=MISTRAL_V11, choice={"type": "function", "function": {
        "name": "echo"}})
    assert feed(tok, named, '[TOOL_CALLS]echo[ARGS]{"text": "hi"}')
    assert allowed(backend, named) == {EOS}


def test_arguments_follow_the_declared_property_order(tok, backend):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"]}}}
    m = matcher(backend, choice="required", tools=[tool])
    assert feed(tok, m, '<tool_call>\n{"name": "f", "arguments": {"')
    assert allowed(backend, m) == set(tok.encode("z", add_special_tokens=False))


def test_none_has_no_constraint_and_the_spec_is_canonical():
    assert tool_call_spec(HERMES, read_tool_set([ADD], "none", None)) is None
    a = tool_call_spec(HERMES, read_tool_set([ADD], "auto", None))
    b = tool_call_spec(HERMES, read_tool_set([json.loads(json.dumps(ADD))], None, None))
    assert a == b and a.key == b.key
    assert StructuredSpec.structural_tag(json.loads(a.value)) == a
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredSpec.structural_tag({"type": "json"})
