"""The Responses API's parts without a server: input items read and turned into chat messages,
the request's translation into a chat body (tools, tool_choice, text.format, refusals), the
bounded store, and the stream of events against the whole response it must add up to."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.request_output import CompletionOutput, RequestOutput
from server.errors import APIError
from server.field_error import FieldError
from server.protocol import ChatCompletionRequest
from server.responses.items import chat_messages, read_input
from server.responses.request import ResponsesRequest
from server.responses.store import ResponseStore, StoredResponse
from server.responses.writer import ResponseDraft, ResponseEvents
from server.tools.formats import HERMES
from server.tools.request import read_tool_set
from tests.support.sse_events import parse_events

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'}


def _param(exc: pytest.ExceptionInfo) -> str | None:
    err = exc.value.errors()[0]["ctx"]["error"] if isinstance(exc.value, ValidationError) \
        else exc.value
    return err.param


def test_input_items_are_normalised_with_ids():
    assert [m["role"] for m in read_input("hi")] == ["user"]
    items = read_input([
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me look"}],
         "id": "msg_given"},
        CALL, {"type": "function_call_output", "call_id": "call_1", "output": "2"}])
    assert [i["type"] for i in items] == ["message", "message", "message", "function_call",
                                          "function_call_output"]  # reasoning left out
    assert items[2]["id"] == "msg_given" and all(i["id"] for i in items)
    assert items[1]["content"] == [{"type": "input_text", "text": "a\nb"}]


@pytest.mark.parametrize("value,param", [
    (42, "input"),
    ([{"role": "robot", "content": "x"}], "input.0.role"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                   {"type": "input_image"}]}], "input.0.content.1.image_url"),
    ([{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}],
     "input.0.content.0.type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input.0.output"),
    ([{"type": "web_search_call"}], "input.0.type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
])
def test_bad_input_items_name_their_field(value, param):
    with pytest.raises(FieldError) as exc:
        read_input(value)
    assert exc.value.param == param


def test_items_become_chat_messages_calls_joining_the_assistant_text():
    items = read_input([{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "looking"}, CALL,
                        {**CALL, "call_id": "call_2"},
                        {"type": "function_call_output", "call_id": "call_1", "output": "r1"},
                        {"type": "function_call_output", "call_id": "call_2", "output": "r2"},
                        {**CALL, "call_id": "call_3"}])
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "looking"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[4] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    ChatCompletionRequest.model_validate({"messages": messages[:4]})  # valid chat history


def test_the_request_becomes_a_chat_body():
    req = ResponsesRequest.model_validate({
        "model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 7,
        "temperature": 0.5, "seed": 3, "top_k": 4, "service_tier": "auto",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "include": [], "reasoning": {"effort": "low"}, "truncation": "disabled"})
    body = req.chat_body([{"role": "user", "content": "before"},
                          {"role": "assistant", "content": "ok"}])
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "before"},
                                {"role": "assistant", "content": "ok"},
                                {"role": "user", "content": "hi"}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (body["max_tokens"], body["temperature"], body["seed"], body["top_k"]) == \
        (7, 0.5, 3, 4)
    assert "service_tier" not in body and body["parallel_tool_calls"] is False
    chat = ChatCompletionRequest.model_validate(body)
    assert chat.tool_set.named == "f" and not chat.tool_set.parallel
    echo = req.echo()
    assert echo["tool_choice"] == {"type": "function", "name": "f"}
    assert echo["text"] == {"format": {"type": "text"}} and echo["parallel_tool_calls"] is False


@pytest.mark.parametrize("fmt,expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                             "strict": True}}),
])
def test_text_format_becomes_a_response_format(fmt, expected):
    body = ResponsesRequest.model_validate({"input": "x", "text": {"format": fmt}}).chat_body([])
    assert body.get("response_format") == expected
    ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools.0.parameters"),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(extra, param):
    with pytest.raises(ValidationError) as exc:
        ResponsesRequest.model_validate({"input": "x", **extra})
    assert _param(exc) == param


def test_the_store_keeps_its_bounds_least_recently_used_first():
    def stored(n: int, pad: int = 0) -> StoredResponse:
        return StoredResponse({"id": f"resp_{n}", "pad": "x" * pad}, [], [])

    store = ResponseStore(max_items=3, max_bytes=10_000)
    for n in range(3):
        assert store.put(stored(n))
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(stored(3))
    assert store.get("resp_1") is None and len(store) == 3  # the least recently used went
    small = store.nbytes
    big = stored(4, pad=9_950)  # fits only alone: the byte bound evicts the others
    assert store.put(big) and store.nbytes == big.nbytes <= 10_000 < big.nbytes + small // 3
    assert len(store) == 1 and store.get("resp_4") is not None
    assert not store.put(stored(5, pad=20_000))  # larger than the whole store: not kept
    assert store.delete("resp_4") and not store.delete("resp_4") and store.nbytes == 0
    off = ResponseStore(max_items=0, max_bytes=10_000)
    assert not off.enabled and not off.put(stored(0)) and off.get("resp_0") is None


def _outputs(texts: list[str], finish: str) -> list[RequestOutput]:
    return [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
        0, text, list(range(len(text))), finish if i == len(texts) - 1 else None)],
        finished=i == len(texts) - 1, num_cached_tokens=2) for i, text in enumerate(texts)]


@pytest.mark.parametrize("tools", [None, read_tool_set(
    [{"type": "function", "function": {"name": "f"}}], "auto", None)])
@pytest.mark.parametrize("texts,finish", [
    (["Hel", "Hello", "Hello there"], "stop"),
    (["Sure.", 'Sure.\n<tool_call>\n{"name": "f", "argu',
      'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'], "stop"),
    (['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'], "stop"),
    ([""], "stop"),
    (["cut sho"], "length"),
])
def test_stream_events_add_up_to_the_whole_response(tools, texts, finish):
    draft = ResponseDraft("resp_1", "m", ResponsesRequest.model_validate(
        {"input": "x"}).echo(), True, tools, HERMES)
    outs = _outputs(texts, finish)
    whole = draft.response(outs[-1])
    kept: list[dict] = []
    events = ResponseEvents(draft, kept.append)
    sse = "".join(events.opening()) + "".join(e for o in outs for e in events.deltas(0, o)) + \
        "".join(events.closing([outs[-1]]))
    parsed = parse_events(sse)
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    final = parsed[-1]["response"]
    assert parsed[-1]["type"] == ("response.incomplete" if finish == "length" else
                                  "response.completed")
    assert kept == [final]

    def shape(items):  # ids are made anew per item
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]

    assert shape(final["output"]) == shape(whole["output"])
    assert final["usage"] == whole["usage"] == {
        "input_tokens": 3, "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": len(texts[-1]), "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 3 + len(texts[-1])}
    deltas = "".join(p["delta"] for p in parsed if p["type"] == "response.output_text.delta")
    messages = [i for i in final["output"] if i["type"] == "message"]
    assert deltas == "".join(m["content"][0]["text"] for m in messages)
    assert "<tool_call>" not in deltas or tools is None
    for p in parsed:
        if p["type"] == "response.output_item.added":
            assert p["item"]["status"] == "in_progress"
        if p["type"] == "response.function_call_arguments.done":
            assert json.loads(p["arguments"]) is not None


def test_a_failed_stream_ends_with_response_failed():
    draft = ResponseDraft("resp_1", "m", {}, False, None, HERMES)
    events = ResponseEvents(draft, lambda _: None)
    body = parse_events(events.failed(APIError(503, "the engine is not running",
                                               code="engine_dead")))
    assert body[0]["type"] == "response.failed"
    assert body[0]["response"]["error"] == {"code": "engine_dead",
                                            "message": "the engine is not running"}


def test_a_reasoning_item_becomes_the_next_assistant_turns_thought():
    from server.responses.items import chat_messages

    thought = {"type": "reasoning", "summary": [],
               "content": [{"type": "reasoning_text", "text": "look it up"}]}
    items = read_input([{"role": "user", "content": "q"}, thought, CALL,
                        {"type": "function_call_output", "call_id": "call_1", "output": "2"},
                        {"role": "assistant", "content": "two"}])
    assert [i["type"] for i in items][:3] == ["message", "reasoning", "function_call"]
    msgs = chat_messages(items)
    assert msgs[1]["role"] == "assistant" and msgs[1]["reasoning_content"] == "look it up"
    assert "reasoning_content" not in msgs[0] and "reasoning_content" not in msgs[-1]
