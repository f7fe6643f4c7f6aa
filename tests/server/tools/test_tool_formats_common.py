"""What the tool-call formats share (and helpers for the per-format tests,
test_tool_formats_*.py): every format is a ``--tool-call-parser`` choice; a chat template that
writes a format's calls chooses it (before hermes' ``<tool_call>``); a whole output and the same
output streamed in pieces of any size (markers split across pieces) give the same content and
calls; each format's constraint, walked by a random "model" (any allowed byte, leaning towards
the ones that close things), gives output that parses into calls valid for the tools' schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from server.config_file import TOOL_CALL_PARSERS
from server.tools.constraint import tool_call_spec
from server.tools.formats import FORMATS, choose_format
from server.tools.parser import StreamingToolParser, ToolCall, parse_tool_calls
from server.tools.request import read_tool_set
from tests.support.byte_grammar import EOS, allowed

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": 2}},
    "required": ["a", "b", "exact"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NEW_FORMATS = ("qwen3_coder", "deepseek_v3", "deepseek_v31", "openai", "granite",
               "phi4_mini_json")


def names(choice="auto", tools=TOOLS):
    return read_tool_set(list(tools), choice, None).names


def streamed(text: str, fmt, pieces: list[int] | None = None, tool_names=None):
    """``(content, calls, parser)`` of ``text`` fed in pieces of the given sizes (cycled;
    default one character at a time)."""
    parser = StreamingToolParser(fmt, tool_names if tool_names is not None else names())
    sizes = pieces or [1]
    events, at, k = [], 0, 0
    while at < len(text):
        n = sizes[k % len(sizes)]
        events += parser.feed(text[at:at + n])
        at, k = at + n, k + 1
    events += parser.finish()
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    return "".join(e for e in events if isinstance(e, str)), calls, parser


def assert_stream_matches(text: str, fmt, tool_names=None) -> None:
    """Streamed in pieces of 1, 2, 3, 5, 7 and mixed sizes, ``text`` gives the whole parse."""
    whole = parse_tool_calls(text, fmt, tool_names if tool_names is not None else names())
    for pieces in ([1], [2], [3], [5], [7], [1, 4, 2, 9, 3]):
        content, calls, _ = streamed(text, fmt, pieces, tool_names)
        assert calls == whole.calls, pieces
        if whole.calls:
            assert (content.rstrip() or None) == whole.content, pieces
        else:
            assert content == (whole.content or ""), pieces


def walk(tok, backend, fmt, choice, seed: int, parallel=None, tools=TOOLS,
         max_steps: int = 3000, prefix: str = "") -> str:
    """A random "model" under the format's constraint, after ``prefix`` (which the constraint
    must accept): each step an allowed token at random (ending when it may with probability
    1/2, preferring one that closes a string, object or tag 2 times in 3), decoded."""
    spec = tool_call_spec(fmt, read_tool_set(list(tools), choice, parallel))
    m = backend.matcher(backend.compile(spec))
    rng = random.Random(seed)
    closers = set(tok.encode('"}]>\n<|`', add_special_tokens=False))
    out: list[int] = tok.encode(prefix, add_special_tokens=False)
    assert all(m.accept(t) for t in out), prefix
    for _ in range(max_steps):
        ok = allowed(backend, m)
        if EOS in ok and (len(ok) == 1 or rng.random() < 0.5):
            break
        ok.discard(EOS)
        closing = sorted(ok & closers)
        token = rng.choice(closing if closing and rng.random() < 2 / 3 else sorted(ok))
        assert m.accept(token)
        out.append(token)
    else:
        pytest.fail(f"no end in {max_steps} steps: {tok.decode(out)!r}")
    return tok.decode(out)


def check_walks(tok, backend, fmt, choice, seeds=range(6), parallel=None, expect=None,
                prefixes=("",)):
    """Random walks under the constraint (after each of ``prefixes`` in turn) parse into calls
    valid for the schemas (at least one for required / named; only ``expect`` for a named
    one); each also streams alike."""
    for seed in seeds:
        text = walk(tok, backend, fmt, choice, seed, parallel,
                    prefix=prefixes[seed % len(prefixes)])
        parsed = parse_tool_calls(text, fmt, names(choice))
        if choice != "auto":
            assert parsed.calls, text
        if parallel is False:
            assert len(parsed.calls) <= 1, text
        for call in parsed.calls:
            assert expect is None or call.name == expect, text
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert_stream_matches(text, fmt, names(choice))


def test_every_format_is_a_parser_choice():
    assert set(NEW_FORMATS) <= set(TOOL_CALL_PARSERS)
    assert tuple(FORMATS) == TOOL_CALL_PARSERS
    for name in NEW_FORMATS:
        fmt, why = choose_format(None, name)
        assert fmt.name == name and why == "--tool-call-parser"


@pytest.mark.parametrize("template,expected", [
    ("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' }}", "qwen3_coder"),
    ("<tool_call>{{ tool_call | tojson }}</tool_call>", "hermes"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name"
     " + '\\n' + '```json' + '\\n' + args + '\\n' + '```' + '<｜tool▁call▁end｜>'}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}",
     "deepseek_v31"),
    ("{{- '<|start|>assistant<|channel|>final<|message|>' }}", "openai"),
])
def test_the_template_chooses_the_format(template, expected):
    fmt, why = choose_format(template)
    assert fmt.name == expected, why


def test_an_unknown_name_or_a_call_to_another_tool_is_text():
    for name in NEW_FORMATS:
        fmt = FORMATS[name]
        text = "Hello." + fmt.render_call("nope", {"x": 1})
        parsed = parse_tool_calls(text, fmt, names())
        assert not parsed.calls, name
        if name != "openai":  # harmony: the message to an unknown function is dropped
            assert parsed.content == text


@pytest.mark.parametrize("name", NEW_FORMATS)
def test_rendered_calls_parse_back(name):
    fmt = FORMATS[name]
    calls = [("get_weather", {"city": "Paris", "unit": "c"}),
             ("add", {"a": 1, "b": -2, "exact": True, "tags": [3]})]
    text = fmt.render_calls(calls)
    parsed = parse_tool_calls(text, fmt, names())
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert_stream_matches(text, fmt)
