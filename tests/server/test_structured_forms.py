"""server.structured_forms through the request models: every form becomes one StructuredSpec,
two forms or a bad form are FieldErrors naming the field."""

from __future__ import annotations

import pydantic
import pytest

from engine.params.structured import StructuredSpec
from server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("extra, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": SCHEMA}}}, StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, StructuredSpec.text("regex", "a+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredSpec.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredSpec.text("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
     StructuredSpec.json_schema(SCHEMA)),
    ({"guided_regex": "a+"}, StructuredSpec.text("regex", "a+")),
    ({"guided_choice": ["a"]}, StructuredSpec.choice(["a"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredSpec.text("grammar", 'root ::= "a"')),
    ({"grammar": 'root ::= "a"'}, StructuredSpec.text("grammar", 'root ::= "a"')),
    ({"json_schema": SCHEMA}, StructuredSpec.json_schema(SCHEMA)),
])
def test_every_form_is_one_spec_on_both_endpoints(extra, want):
    chat = ChatCompletionRequest(messages=MSGS, **extra)
    comp = CompletionRequest(prompt="x", **extra)
    for req in (chat, comp):
        assert req.structured == want
        assert req.sampling_params(max_tokens=4, logprobs=None).structured == want


@pytest.mark.parametrize("extra, match", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "one structured"),
    ({"grammar": "root ::= \"a\"", "json_schema": SCHEMA}, "one structured"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"outlines": 1}}, "not supported"),
    ({"response_format": {"type": "xml"}}, "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "json_schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "required"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_choice": []}, "non-empty"),
    ({"json_schema": {"description": "x" * 200_000}}, "at most"),
])
def test_bad_forms_are_refused(extra, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ChatCompletionRequest(messages=MSGS, **extra)
