"""server.tools.parser and server.tools.formats: per format, complete output, output cut short,
the same text streamed character by character (identical result, no marker text in the
content), malformed or unknown-name output as plain text, several calls in one message (for
mistral, several in one [TOOL_CALLS] array, and its v11 name[ARGS]{...} form)."""

from __future__ import annotations

import json

import pytest

from server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, choose_format
from server.tools.parser import StreamingToolParser, ToolCall, parse_tool_calls

NAMES = {"get_weather", "add"}


def hermes(name: str, args: dict) -> str:
    return HERMES.render_call(name, args)


def llama(name: str, args: dict) -> str:
    return LLAMA3_JSON.render_call(name, args)


def streamed(text: str, fmt, names=NAMES, step: int = 1):
    p = StreamingToolParser(fmt, names)
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i:i + step])
    events += p.finish()
    return events


CASES = [
    # (format, text, expected content, expected calls)
    (HERMES, "The weather:\n" + hermes("get_weather", {"city": "Paris"}),
     "The weather:", [("get_weather", {"city": "Paris"})]),
    (HERMES, hermes("get_weather", {"city": "Oslo"}) + "\n" + hermes("add", {"a": 1, "b": 2}),
     None, [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    (HERMES, "no call here, just <tool text and a < sign", "no call here, just <tool text and "
     "a < sign", []),
    (HERMES, "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>",
     []),
    (HERMES, hermes("launch_missiles", {}), hermes("launch_missiles", {}), []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',  # cut: no close
     None, [("add", {"a": 1, "b": 2})]),
    (HERMES, '<tool_call>\n{"name": "add", "argum', '<tool_call>\n{"name": "add", "argum', []),
    (HERMES, "x " + hermes("add", {"a": 1}) + " trailing text", "x", [("add", {"a": 1})]),
    (HERMES, "text with trailing space  \n", "text with trailing space  \n", []),
    (LLAMA3_JSON, llama("get_weather", {"city": "Rome"}), None,
     [("get_weather", {"city": "Rome"})]),
    (LLAMA3_JSON, "<|python_tag|>" + llama("add", {"a": 2}) + "; " + llama("add", {"a": 3}),
     None, [("add", {"a": 2}), ("add", {"a": 3})]),
    (LLAMA3_JSON, 'Sure. {"name": "add", "parameters": {"a": "}"}}', "Sure.",
     [("add", {"a": "}"})]),
    (LLAMA3_JSON, 'a set {1, 2} and {"name": 5}', 'a set {1, 2} and {"name": 5}', []),
    (LLAMA3_JSON, '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    (LLAMA3_JSON, "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (LLAMA3_JSON, '<|python_tag|> {"name": "add", "parameters": {"a": 1}}', None,
     [("add", {"a": 1})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    (MISTRAL, 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[x]"}}, '
     '{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abc123def"}]</s>', "Let me check.",
     [("get_weather", {"city": "[x]"}), ("add", {"a": 1, "b": 2})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 1}"}] trailing', None,
     [("add", {"a": 1})]),
    (MISTRAL, '[TOOL_CALLS]{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "nope", '
     '"arguments": {}}]', '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "nope", '
     '"arguments": {}}]', []),  # an unknown name: the whole array is text
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', '[TOOL_CALLS][{"name": '
     '"add", "arguments": {"a": 1}', []),  # cut short: not complete JSON
    (MISTRAL, "[TOOL_CALLS][not json]", "[TOOL_CALLS][not json]", []),
    (MISTRAL, "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    (MISTRAL, "a [TOOL]  list [1, 2] and [TOOL_CALLS] what", "a [TOOL]  list [1, 2] and "
     "[TOOL_CALLS] what", []),
    (MISTRAL, 'x [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
     "x", [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
    (MISTRAL, '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 2}', None, [("add", {"a": 2})]),
    (MISTRAL, '[TOOL_CALLS]add{"a": 3}', None, [("add", {"a": 3})]),
    (MISTRAL, '[TOOL_CALLS]add[ARGS]{"a": ', '[TOOL_CALLS]add[ARGS]{"a": ', []),
    (MISTRAL, '[TOOL_CALLS]nope[ARGS]{"a": 1}', '[TOOL_CALLS]nope[ARGS]{"a": 1}', []),
    (MISTRAL_V11, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 4}}]', None,
     [("add", {"a": 4})]),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_and_streamed_agree(fmt, text, content, calls):
    out = parse_tool_calls(text, fmt, NAMES)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    for step in (1, 3, 7):
        events = streamed(text, fmt, step=step)
        got_calls = [e for e in events if isinstance(e, ToolCall)]
        got_text = "".join(e for e in events if isinstance(e, str))
        assert got_calls == list(out.calls)
        assert got_text == (out.content or "")
        if calls:
            for marker in fmt.markers:
                assert marker not in got_text


def test_streaming_holds_back_only_what_could_be_a_marker():
    p = StreamingToolParser(HERMES, NAMES)
    assert p.feed("Hello") == ["Hello"]
    assert p.feed(" <tool") == []  # could be a call: held (the space too)
    assert p.feed("box>") == [" <toolbox>"]  # it was not
    assert p.feed("\n<tool_call>\n{") == []
    assert p.feed('"name": "add", "arguments": {"a": 1}}\n</tool_call>') == [
        ToolCall("add", '{"a": 1}')]
    assert p.feed(" more text") == []  # after a call: dropped
    assert p.finish() == []


def test_arguments_keep_unicode_and_arguments_as_a_json_string_are_accepted():
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": \\"é\\"}"}\n</tool_call>'
    assert parse_tool_calls(text, HERMES, NAMES).calls == (ToolCall("add", '{"a": "é"}'),)


@pytest.mark.parametrize("template,given,expected", [
    ("{{ '<tool_call>' }}", None, "hermes"),
    ('{{ "parameters" }} <|python_tag|>', None, "llama3_json"),
    ("{% if m.role == 'ipython' %}", None, "llama3_json"),
    ("plain ChatML", None, "hermes"),
    (None, None, "hermes"),
    ("{{ '<tool_call>' }}", "llama3_json", "llama3_json"),
    ("{{ '[TOOL_CALLS] [' }}{{ tool_call.function.parameters }}", None, "mistral"),
    (None, "mistral", "mistral"),
])
def test_choose_format(template, given, expected):
    fmt, why = choose_format(template, given)
    assert fmt.name == expected and why


def test_choose_format_picks_mistrals_v11_form_from_the_template():
    assert choose_format("{{ '[TOOL_CALLS] [' }}")[0] is MISTRAL
    fmt, why = choose_format("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}")
    assert fmt is MISTRAL_V11 and "[ARGS]" in why
    assert choose_format("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral")[0] is MISTRAL_V11
    assert choose_format("[TOOL_CALLS]", "hermes")[0] is HERMES


def test_mistral_streams_nothing_of_the_array_into_the_content():
    p = StreamingToolParser(MISTRAL, NAMES)
    assert p.feed("Checking") == ["Checking"]
    assert p.feed(" [TOOL") == []  # could be the marker: held (the space too)
    assert p.feed('_CALLS] [{"name": "add", "arguments": {"a": [1, "]"]}}, ') == []
    assert p.feed('{"name": "add", "arguments": {"a": 2}}') == []
    assert p.feed("]") == [ToolCall("add", '{"a": [1, "]"]}'), ToolCall("add", '{"a": 2}')]
    assert p.finish() == []
    p = StreamingToolParser(MISTRAL, NAMES)
    assert p.feed("[TOOLS] x") == ["[TOOLS] x"]


def test_mistral_renders_calls_and_gives_mistral_ids():
    calls = [("add", {"a": 1}), ("get_weather", {"city": "Paris"})]
    text = MISTRAL.render_calls(calls)
    assert text == ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert MISTRAL_V11.render_calls(calls) == ('[TOOL_CALLS]add[ARGS]{"a": 1}'
                                               '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    for fmt in (MISTRAL, MISTRAL_V11):
        out = parse_tool_calls(fmt.render_calls(calls), fmt, NAMES)
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    ident = MISTRAL.call_id()
    assert len(ident) == 9 and ident.isalnum() and HERMES.call_id().startswith("call_")
    assert MISTRAL.template_call_id("call_0123456789abcdef") == "789abcdef"
    assert MISTRAL.template_call_id("call_1") == "00000call1"[-9:]
    assert MISTRAL.template_call_id("abc123XYZ") == "abc123XYZ"
    assert HERMES.template_call_id("call_1") == "call_1"


def test_choose_format_refuses_an_unknown_parser():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        choose_format(None, "pythonic")
