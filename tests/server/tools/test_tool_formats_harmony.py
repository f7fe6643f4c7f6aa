"""openai (server/tools/harmony.py): gpt-oss's harmony messages. The analysis channel is
reasoning, a message to functions.NAME a call, the final channel (and a commentary with no
recipient) content; whole and streamed one character at a time (markers split across pieces)
alike; a call whose <|call|> stop token is not in the text, the recipient before the channel,
unknown functions and broken JSON, plain text with no harmony at all; the template chooses the
format; the constraint (an optional analysis message, then the calls or a final answer) walked
at random gives calls valid for the schemas; and, where openai-harmony's vocabulary loads, the
messages match its own parser's."""

from __future__ import annotations

import json

import pytest

from server.tools.formats import choose_format
from server.tools.harmony import HARMONY, HarmonyMessage, read_messages, split_output
from server.tools.parser import parse_tool_calls
from tests.server.tools.test_tool_formats_common import (
    assert_stream_matches,
    check_walks,
    names,
    streamed,
)

THINK = "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris", "unit": "c"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C in Paris.<|return|>"
WEATHER = ("get_weather", {"city": "Paris", "unit": "c"})
OUTPUTS = [
    THINK + CALL,
    THINK + CALL[:-len("<|call|>")],  # gpt-oss stops on <|call|>: it may not reach the text
    THINK + FINAL,
    THINK + FINAL[:-len("<|return|>")],
    THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", '
    '"unit": "c"}<|call|>',
    THINK + CALL + CALL.replace("Paris", "Rome"),
    THINK + CALL.replace("get_weather", "nope"),
    THINK + CALL.replace('{"city"', "{city"),
    "Just plain text, no harmony.",
    "",
]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_channels_split_into_reasoning_calls_and_content():
    thought = "The user wants the weather; call get_weather."
    assert split_output(THINK + CALL, names()) == (thought, None, split_output(
        CALL, names())[2])
    reasoning, content, calls = split_output(THINK + FINAL, names())
    assert (reasoning, content, calls) == (thought, "It is 18 C in Paris.", ())
    parsed = parse_tool_calls(THINK + CALL, HARMONY, names())
    assert parsed.content is None and _calls(parsed) == [WEATHER]
    parsed = parse_tool_calls(THINK + FINAL, HARMONY, names())
    assert parsed.content == "It is 18 C in Paris." and parsed.calls == ()


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_one_character_at_a_time_as_whole(text):
    assert_stream_matches(text, HARMONY)
    reasoning, content, calls = split_output(text, names())
    got_content, got_calls, parser = streamed(text, HARMONY)
    assert got_content == (content or "") and "<|" not in got_content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [
        (c.name, c.arguments) for c in calls]
    assert parser.take_reasoning() == (reasoning or "") and parser.take_reasoning() == ""


def test_edge_cases():
    assert _calls(parse_tool_calls(OUTPUTS[1], HARMONY, names())) == [WEATHER]
    assert parse_tool_calls(OUTPUTS[3], HARMONY, names()).content == "It is 18 C in Paris."
    r, c, calls = split_output(OUTPUTS[4], names())
    assert c == "Checking." and [x.name for x in calls] == ["get_weather"]
    assert _calls(parse_tool_calls(OUTPUTS[5], HARMONY, names())) == [WEATHER]
    assert [json.loads(c.arguments)["city"] for c in
            parse_tool_calls(OUTPUTS[6], HARMONY, names()).calls] == ["Paris", "Rome"]
    for broken in OUTPUTS[7:9]:  # an unknown function, arguments that are no JSON: dropped
        parsed = parse_tool_calls(broken, HARMONY, names())
        assert parsed.calls == () and parsed.content is None
    assert parse_tool_calls(OUTPUTS[9], HARMONY, names()).content == OUTPUTS[9]
    assert read_messages(THINK + FINAL) == [
        HarmonyMessage("analysis", None, "The user wants the weather; call get_weather."),
        HarmonyMessage("final", None, "It is 18 C in Paris.")]


def test_the_template_chooses_the_format():
    gpt_oss = ("{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
               "{{- '<|start|>assistant to=' + 'functions.' + tool_call.name + "
               "'<|channel|>commentary ' + (tool_call.content_type if tool_call.content_type "
               "is defined else 'json') + '<|message|>' }}")
    fmt, why = choose_format(gpt_oss)
    assert fmt is HARMONY, why
    assert fmt.special_marker
    assert HARMONY.render_calls([WEATHER]) == CALL[len("<|start|>assistant"):]


@pytest.mark.parametrize("choice,parallel,expect", [
    ("required", None, None), ("required", False, None), ("auto", None, None),
    ({"type": "function", "function": {"name": "add"}}, None, "add")])
def test_constrained_random_output_parses_into_valid_calls(tok, backend, choice, parallel,
                                                           expect):
    # Free text (the analysis, a final answer) ends only on its marker, which a random walk
    # does not write: the walks start past the thought (or skip it) into a call.
    thought = "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant"
    prefixes = (thought + "<|channel|>commentary", "<|channel|>commentary")
    check_walks(tok, backend, HARMONY, choice, seeds=range(4), parallel=parallel,
                expect=expect, prefixes=prefixes)


def test_auto_allows_a_final_answer_and_required_does_not(tok, backend):
    from server.tools.constraint import tool_call_spec
    from server.tools.request import read_tool_set
    from tests.server.tools.test_tool_formats_common import TOOLS
    from tests.support.byte_grammar import EOS, allowed

    def matcher(choice):
        spec = tool_call_spec(HARMONY, read_tool_set(TOOLS, choice, None))
        return backend.matcher(backend.compile(spec))

    def feed(m, text):
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    m = matcher("auto")
    assert feed(m, THINK[:-len("<|end|>")] + "<|end|>" + FINAL[:-len("<|return|>")])
    assert not feed(matcher("auto"), THINK + "<|start|>assistant<|channel|>analysis")
    assert feed(m, "<|return|>") and EOS in allowed(backend, m)
    m = matcher("required")
    assert EOS not in allowed(backend, m)
    assert feed(m, THINK + "<|start|>assistant<|channel|>")
    assert not feed(m, "final")
    m = matcher({"type": "function", "function": {"name": "add"}})
    assert not feed(m, CALL[len("<|start|>assistant"):])  # not the named function


def _harmony_encoding():
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # no vocabulary file offline
        pytest.skip(f"openai-harmony's gpt-oss encoding does not load here: {exc}")


@pytest.mark.parametrize("text", [THINK + CALL, THINK + FINAL, OUTPUTS[4]])
def test_messages_match_openai_harmony(text):
    from openai_harmony import Role, StreamableParser

    enc = _harmony_encoding()
    parser = StreamableParser(enc, role=Role.ASSISTANT)
    for token in enc.encode(text, allowed_special="all"):
        parser.process(token)
    parser.process_eos()
    theirs = [(m.channel, m.recipient, "".join(c.text for c in m.content))
              for m in parser.messages]
    ours = [(m.channel, m.recipient, m.content) for m in read_messages(text)]
    assert ours == theirs
