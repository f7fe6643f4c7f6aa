"""End to end on the real server (embedded SmolLM2-135M, kvserve's default hermes prompt) with
the real OpenAI SDK: a named call cut by a small ``max_tokens`` comes back as OpenAI's partial
call (``content`` None, ``finish_reason`` "length", arguments a prefix of the uncut call's, at
temperature 0), and a streamed call's arguments arrive in several pieces that concatenate to
the non-streamed arguments."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _create(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                          tool_choice=NAMED, temperature=0, **kw)


def test_a_call_cut_by_max_tokens_is_a_partial_call(real_server):
    client = real_server.client()
    whole = _create(client, max_tokens=100).choices[0]
    assert whole.finish_reason == "tool_calls"
    full = whole.message.tool_calls[0].function.arguments
    json.loads(full)
    # the markup before the arguments is about 18 tokens (docs/tools.md): cut inside them
    cut = _create(client, max_tokens=24).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    [call] = cut.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert full.startswith(call.function.arguments) and call.function.arguments != full
    assert "<tool_call>" not in call.function.arguments


def test_streamed_arguments_arrive_in_pieces(real_server):
    client = real_server.client()
    full = _create(client, max_tokens=100).choices[0].message.tool_calls[0].function.arguments
    heads, pieces, finish = [], [], None
    for chunk in _create(client, max_tokens=100, stream=True):
        assert not chunk.choices[0].delta.content
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.id:
                heads.append((part.function.name, part.function.arguments))
            elif part.function.arguments:
                pieces.append(part.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert heads == [("get_weather", "")] and finish == "tool_calls"
    assert len(pieces) > 1 and "".join(pieces) == full
