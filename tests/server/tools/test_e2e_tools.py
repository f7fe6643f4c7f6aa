"""End to end: tool calling on the real server (embedded SmolLM2-135M, whose template has no
tools: kvserve's default Hermes-style prompt) with the real OpenAI SDK. ``required`` and a
named function always give calls whose arguments validate against the tool's schema; ``auto``
gives well-formed text or calls; ``none`` no calls; streamed calls reassemble to the
non-streamed ones at temperature 0; a tool-result turn is served; bad tools, tool choices and
tool messages are 400s and the server serves on; ``GET /v1/models/{id}``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import assert_error

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client, **kw):
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100)
    args.update(kw)
    return client.chat.completions.create(**args)


def _check_calls(choice, names=tuple(SCHEMAS)):
    calls = choice.message.tool_calls
    assert calls, choice.message
    assert choice.finish_reason == "tool_calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("choice,names", [("required", tuple(SCHEMAS)),
                                          (NAMED, ("get_weather",))])
def test_required_and_named_calls_validate(real_server, choice, names):
    r = _create(real_server.client(), tool_choice=choice, parallel_tool_calls=False)
    calls = _check_calls(r.choices[0], names)
    assert len(calls) == 1  # parallel_tool_calls false
    assert r.choices[0].message.content is None


def test_auto_gives_text_or_valid_calls_and_none_gives_text(real_server):
    client = real_server.client()
    for seed in (0, 1):
        choice = _create(client, temperature=1, seed=seed).choices[0]  # tool_choice auto
        if choice.message.tool_calls:
            _check_calls(choice)
        else:
            assert isinstance(choice.message.content, str)
            assert "<tool_call>" not in choice.message.content or choice.finish_reason == \
                "length"
    r = _create(client, tool_choice="none", max_tokens=30)
    assert not r.choices[0].message.tool_calls
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_calls_reassemble_to_the_non_streamed_ones(real_server):
    client = real_server.client()
    whole = _create(client, tool_choice=NAMED).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in _check_calls(whole)]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in _create(client, tool_choice=NAMED, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                assert call["id"] is None and part.function.name
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_result_turn_is_served(real_server):
    client = real_server.client()
    first = _create(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    call = _check_calls(first)[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):
        r = _create(client, messages=history, max_tokens=40, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=20)
    assert isinstance(r.choices[0].message.content, str)


def test_bad_tool_input_is_a_400_and_the_server_serves_on(real_server):
    url, headers = f"{real_server.url}/v1/chat/completions", real_server.headers

    def post(**body):
        return httpx.post(url, headers=headers, timeout=120,
                          json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})

    not_object = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}
    assert_error(post(tools=[not_object]), 400, param="tools.0.function.parameters",
                 contains="object")
    assert_error(post(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]), 400,
        contains="nonsense")  # not a schema: xgrammar refuses to compile it
    assert_error(post(tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "missing"}}), 400, param="tool_choice.function.name", contains="missing")
    assert_error(post(messages=[*ASK, {"role": "tool", "tool_call_id": "call_x",
                                       "content": "42"}]), 400,
                 param="messages.1.tool_call_id", contains="call_x")
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert_error(post(tools=many), 400, param="tools", contains="128")
    assert_error(post(tools=TOOLS, response_format={"type": "json_object"}), 400,
                 param="tools", contains="one constraint")
    assert httpx.get(f"{real_server.url}/health", timeout=10).status_code == 200
    ok = post(tools=TOOLS, tool_choice="none")
    assert ok.status_code == 200, ok.text


def test_models_retrieve(real_server):
    client = real_server.client()
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
