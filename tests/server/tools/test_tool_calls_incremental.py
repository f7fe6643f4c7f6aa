"""server.tools.parser's incremental reading (what /v1/chat/completions uses): a call cut by the
end of the output comes back as OpenAI gives it (name, arguments as far as written, possibly
incomplete JSON; never the markup as content; dropped when cut before its name), calls stream
their arguments piece by piece and the pieces concatenate to the whole output's arguments;
formats read whole stay correct."""

from __future__ import annotations

import json

import pytest

from server.tools.formats import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11
from server.tools.parser import (
    ArgumentsDelta,
    CallStart,
    StreamingToolParser,
    ToolCall,
    collect_calls,
    parse_tool_calls,
)

NAMES = {"get_weather", "add"}
ARGS = {"city": "Paris", "days": [1, {"x": 2}], "note": "a \"quoted\" }"}
CALL = HERMES.render_call("get_weather", ARGS)
TEXT = "Sure.\n" + CALL
WHOLE = json.dumps(ARGS, ensure_ascii=False)  # the arguments' text in CALL


def parse(text, fmt=HERMES, cut=True):
    return parse_tool_calls(text, fmt, NAMES, incremental=True, cut=cut)


def streamed(text, fmt=HERMES, step=1, cut=True):
    p = StreamingToolParser(fmt, NAMES, incremental=True)
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i:i + step])
    return events + p.finish(cut)


def test_a_whole_call_reads_as_before():
    out = parse(TEXT, cut=False)
    assert out.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", ARGS)]


@pytest.mark.parametrize("cut", range(len("Sure.\n<"), len(TEXT)))
def test_a_cut_hermes_call_is_a_partial_openai_call_never_markup(cut):
    out = parse(TEXT[:cut])
    assert out.content == "Sure."  # the text before the call only: no markup
    name_written = TEXT.index('"get_weather"') + len('"get_weather"')
    if cut < name_written:
        assert out.calls == ()  # cut before the name: no call, no tool_calls
        return
    [call] = out.calls
    assert call.name == "get_weather"
    assert WHOLE.startswith(call.arguments)  # the JSON text written so far


def test_a_cut_before_the_name_with_no_text_before_gives_null_content_and_no_calls():
    out = parse('<tool_call>\n{"name": "get_we')
    assert out.content is None and out.calls == ()


def test_completed_calls_before_the_cut_stay():
    second = HERMES.render_call("add", {"a": 1, "b": 2})
    out = parse(CALL + "\n" + second[:-25])
    assert [c.name for c in out.calls] == ["get_weather", "add"]
    assert json.loads(out.calls[0].arguments) == ARGS
    assert out.calls[1].arguments == '{"a": 1, "b": 2}'[:len(out.calls[1].arguments)]
    assert out.content is None


def test_arguments_stream_piece_by_piece_and_concatenate_to_the_whole():
    events = streamed(TEXT)
    start = next(i for i, e in enumerate(events) if isinstance(e, CallStart))
    assert events[start] == CallStart("get_weather")
    pieces = [e.text for e in events[start + 1:]]
    assert all(isinstance(e, ArgumentsDelta) for e in events[start + 1:])
    assert len(pieces) > 10  # one a character here, not one at the end
    assert "".join(pieces) == parse(TEXT).calls[0].arguments
    assert json.loads("".join(pieces)) == ARGS


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("cut", [None, 40, 60, 90])
def test_streamed_and_whole_agree(step, cut):
    text = TEXT if cut is None else TEXT[:cut]
    events = streamed(text, step=step)
    assert collect_calls(events) == parse(text).calls
    assert "".join(e for e in events if isinstance(e, str)) == (parse(text).content or "")


def test_control_characters_in_strings_are_escaped_so_the_arguments_are_strict_json():
    text = '<tool_call>\n{"name": "add", "arguments": {"note": "a\nb\tc"}}\n</tool_call>'
    [call] = parse(text).calls
    assert json.loads(call.arguments) == {"note": "a\nb\tc"}
    assert "".join(e.text for e in streamed(text) if isinstance(e, ArgumentsDelta)) == \
        call.arguments


@pytest.mark.parametrize("fmt,text,args", [
    (LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1, "b": 2}}', '{"a": 1, "b": 2}'),
    (MISTRAL_V11, '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', '{"a": 1, "b": 2}'),
    (MISTRAL, '[TOOL_CALLS]{"name": "add", "arguments": {"a": 1, "b": 2}}', '{"a": 1, "b": 2}'),
])
def test_other_json_in_order_formats_stream_and_cut_alike(fmt, text, args):
    assert collect_calls(streamed(text, fmt)) == (ToolCall("add", args),)
    assert sum(isinstance(e, ArgumentsDelta) for e in streamed(text, fmt)) > 3
    out = parse(text[:text.index(args) + len(args) - 3], fmt)
    assert out.content is None and out.calls == (ToolCall("add", args[:-3]),)


def test_arguments_given_as_a_json_string_come_whole():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse(text).calls == (ToolCall("add", '{"a": 1}'),)
    assert collect_calls(streamed(text)) == (ToolCall("add", '{"a": 1}'),)
    assert parse(text[:-15]).calls == (ToolCall("add", ""),)  # cut: no markup as arguments


@pytest.mark.parametrize("name", ["qwen3_coder", "deepseek_v3", "deepseek_v31", "granite",
                                  "phi4_mini_json", "mistral"])
def test_formats_read_whole_give_a_call_at_its_end_and_drop_a_cut_one(name):
    fmt = FORMATS[name]
    call = fmt.render_calls([("add", {"a": "x"})])
    events = streamed("Sure. " + call, fmt, cut=False)
    assert [e for e in events if not isinstance(e, str)] == [ToolCall("add", '{"a": "x"}')]
    out = parse("Sure. " + call[:len(call) // 2], fmt)
    assert out.calls == () and out.content == "Sure."  # no markup in the content


def test_a_marker_cut_short_is_dropped_only_when_the_output_was_cut():
    assert parse("Sure. <tool_ca").content == "Sure."
    assert parse("Sure. <tool_ca", cut=False).content == "Sure. <tool_ca"
    assert parse("1 < 2", cut=False).content == "1 < 2"


def test_without_incremental_the_old_reading_stays():
    """Other endpoints (Anthropic's, the Responses API) read calls whole, a cut block as text."""
    cut = TEXT[:60]
    assert parse_tool_calls(cut, HERMES, NAMES).content == cut
    assert all(isinstance(e, (str, ToolCall))
               for e in StreamingToolParser(HERMES, NAMES).feed(TEXT))
