"""End to end: the Responses API on the real server (embedded SmolLM2-135M) with the real
OpenAI SDK: text, ``instructions``, function tools (required, named; arguments validate),
a ``function_call_output`` turn, ``previous_response_id`` (the continuation is served from the
prefix cache), ``text.format`` JSON schemas, streaming events in order (and the SDK's own
stream helper), ``GET``/``DELETE``/``input_items``, and bad input as clear 4xx errors after
which the server serves on."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import assert_error
from tests.support.sse_events import parse_events

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in "
           "a city", "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {
           "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
           "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
           "required": ["a", "b"]}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
INSTRUCTIONS = ("You are a careful assistant for a travel agency. You answer questions about "
                "cities, their weather and their sights, briefly and politely.")


def _create(client, **kw):
    args = dict(model=MODEL, input="What is the weather in Paris?", temperature=0,
                max_output_tokens=60)
    args.update(kw)
    return client.responses.create(**args)


def _calls(response, names=tuple(SCHEMAS)):
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.name in names and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_text_response_has_openai_shape(real_server):
    r = _create(real_server.client(), input="Say hello.", instructions=INSTRUCTIONS,
                max_output_tokens=12, metadata={"case": "text"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    assert r.instructions == INSTRUCTIONS and r.metadata == {"case": "text"}
    u = r.usage
    assert u.output_tokens <= 12 and u.total_tokens == u.input_tokens + u.output_tokens
    if r.status == "incomplete":
        assert u.output_tokens == 12 and r.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("choice,names", [("required", tuple(SCHEMAS)),
                                          ({"type": "function", "name": "get_weather"},
                                           ("get_weather",))])
def test_function_tools_give_valid_calls(real_server, choice, names):
    r = _create(real_server.client(), tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False)
    assert r.status == "completed"
    assert len(_calls(r, names)) == 1
    assert all(item.type == "function_call" for item in r.output)


def test_a_tool_loop_continues_with_previous_response_id_from_the_prefix_cache(real_server):
    client = real_server.client()
    first = _create(client, tools=TOOLS, tool_choice="required", instructions=INSTRUCTIONS,
                    parallel_tool_calls=False)
    call = _calls(first)[0]
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "18 degrees and sunny"}
    second = _create(client, previous_response_id=first.id, input=[result], tools=TOOLS,
                     tool_choice="none", instructions=INSTRUCTIONS, max_output_tokens=30)
    assert second.previous_response_id == first.id
    assert second.output[0].type == "message" and isinstance(second.output_text, str)
    # The same instructions and the predecessor's conversation: its prompt is served from the
    # prefix cache (all but the last, partial block at least).
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    # The same conversation sent whole (no stored state) renders the same prompt.
    whole = _create(client, input=[{"role": "user", "content": "What is the weather in Paris?"},
                                   call.model_dump(include={"type", "call_id", "name",
                                                            "arguments"}), result],
                    tools=TOOLS, tool_choice="none", instructions=INSTRUCTIONS,
                    max_output_tokens=30, store=False)
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_text_format_json_schema_gives_valid_json(real_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = _create(real_server.client(), max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_stream_events_come_in_order_and_match_the_whole_response(real_server):
    client = real_server.client()
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "name": "add"},
              input="Add 2 and 3.")
    whole = _create(client, **kw)
    r = httpx.post(f"{real_server.url}/v1/responses", headers=real_server.headers,
                   timeout=300, json={"model": MODEL, "input": "Add 2 and 3.", "tools": TOOLS,
                                      "tool_choice": {"type": "function", "name": "add"},
                                      "temperature": 0, "max_output_tokens": 60,
                                      "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    events = parse_events(r.text)
    assert [e["type"] for e in events] == names
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    done = events[-2]["item"]
    assert (done["name"], done["arguments"]) == (whole.output[0].name, whole.output[0].arguments)
    assert events[4]["arguments"] == done["arguments"] == events[3]["delta"]
    assert client.responses.retrieve(final["id"]).output[0].call_id == done["call_id"]


def test_streamed_text_through_the_sdk_helper(real_server):
    client = real_server.client()
    whole = _create(client, input="Name a color.", max_output_tokens=8)
    deltas, kinds = [], []
    with client.responses.stream(model=MODEL, input="Name a color.", temperature=0,
                                 max_output_tokens=8) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else
                         "response.completed")
    assert "".join(deltas) == whole.output_text


def test_get_delete_and_input_items(real_server):
    client = real_server.client()
    r = _create(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello"}]}, {"role": "user", "content": "there"}],
        max_output_tokens=4)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["there", "Hello"]  # newest first
    items = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.content[0].text for i in items.data] == ["Hello"] and items.has_more
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_bad_input_is_a_clear_4xx_and_the_server_serves_on(real_server):
    url, headers = f"{real_server.url}/v1/responses", real_server.headers

    def post(**body):
        return httpx.post(url, headers=headers, timeout=120,
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **body})

    err = assert_error(post(previous_response_id="resp_missing"), 404,
                       param="previous_response_id", code="response_not_found")
    assert "resp_missing" in err["message"]
    assert_error(post(tools=[{"type": "web_search"}]), 400, param="tools.0.type",
                 contains="web_search")
    assert_error(post(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "array"}}]), 400, param="tools.0.parameters", contains="object")
    assert_error(post(tools=TOOLS, tool_choice={"type": "function", "name": "missing"}), 400,
                 param="tool_choice.name", contains="missing")
    assert_error(post(input=[{"type": "function_call_output", "call_id": "call_x",
                              "output": "42"}]), 400, param="input.0.call_id",
                 contains="call_x")
    assert_error(post(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]), 400,
        param="input.0.content.0.image_url", contains="--allowed-media-domains")
    assert_error(post(input="word " * 3000), 400, param="input", contains="1024")  # context
    many = [{"type": "function", "name": f"f{i}"} for i in range(1000)]
    assert_error(post(tools=many), 400, param="tools", contains="128")
    for field, value in (("background", True), ("truncation", "auto"),
                         ("conversation", "conv_1"), ("include", ["file_search_call.results"])):
        assert_error(post(**{field: value}), 400, param=field)
    assert_error(post(model="gpt-4o"), 404, param="model")
    assert httpx.get(f"{real_server.url}/health", timeout=10).status_code == 200
    assert post().status_code == 200
