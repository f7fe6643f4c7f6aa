"""granite and phi4_mini_json (server/tools/json_array.py): a marker and a JSON array of calls,
<|tool_call|>[...] (and Granite 3.1's <tool_call>[...]) and functools[...], whole and streamed
(markers split across pieces), content before the calls, several calls in one array, prose that
only mentions the marker; the templates choose the formats; the constraints (mistral's array
under the format's marker) walked at random give calls valid for the schemas."""

from __future__ import annotations

import json

import pytest

from server.tools.formats import choose_format
from server.tools.json_array import GRANITE, PHI4_MINI_JSON
from server.tools.parser import parse_tool_calls
from server.tools.prompt import default_preamble
from tests.server.tools.test_tool_formats_common import (
    TOOLS,
    assert_stream_matches,
    check_walks,
    names,
    streamed,
)

ARRAY = ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
         '{"name": "add", "arguments": {"a": 1, "b": 2, "exact": true}}]')
EXPECTED = [("get_weather", {"city": "Paris", "unit": "c"}),
            ("add", {"a": 1, "b": 2, "exact": True})]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt,marker", [(GRANITE, "<|tool_call|>"), (GRANITE, "<tool_call>"),
                                        (PHI4_MINI_JSON, "functools")])
def test_an_array_of_calls_whole_and_streamed(fmt, marker):
    for text, content in ((marker + ARRAY, None), (f"Both.\n{marker}{ARRAY}", "Both."),
                          (f"{marker} {ARRAY}", None)):
        parsed = parse_tool_calls(text, fmt, names())
        assert _calls(parsed) == EXPECTED and parsed.content == content, text
        assert_stream_matches(text, fmt)
        got, calls, _ = streamed(text, fmt)
        assert marker not in got and len(calls) == 2


def test_prose_mentioning_the_marker_is_content():
    for text in ("Use functools.partial here.", "import functools\n\nfunctools[0] is wrong",
                 "the <|tool_call|> token"):
        fmt = PHI4_MINI_JSON if "functools" in text else GRANITE
        parsed = parse_tool_calls(text, fmt, names())
        assert parsed.calls == () and parsed.content == text
        assert_stream_matches(text, fmt)


def test_the_templates_choose_the_formats_and_ids_are_openai_style():
    granite = ("{%- elif message['role'] == 'assistant_tool_call' %}{{- '<|start_of_role|>"
               "assistant<|end_of_role|><|tool_call|>' + message['content'] + "
               "'<|end_of_text|>\\n' }}")
    assert choose_format(granite)[0] is GRANITE
    phi = "{{ '<|assistant|>functools' + message['tool_calls'] | tojson + '<|end|>' }}"
    assert choose_format(phi)[0] is PHI4_MINI_JSON
    assert GRANITE.call_id().startswith("call_") and GRANITE.template_call_id("call_x") == "call_x"
    preamble = default_preamble(TOOLS, PHI4_MINI_JSON)
    assert 'functools[{"name": <function-name>, "arguments": <arguments-object>}]' in preamble


@pytest.mark.parametrize("fmt", [GRANITE, PHI4_MINI_JSON])
@pytest.mark.parametrize("choice,parallel,expect", [
    ("required", None, None), ("required", False, None), ("auto", None, None),
    ({"type": "function", "function": {"name": "add"}}, None, "add")])
def test_constrained_random_output_parses_into_valid_calls(tok, backend, fmt, choice, parallel,
                                                           expect):
    check_walks(tok, backend, fmt, choice, seeds=range(4), parallel=parallel, expect=expect)
