"""An Anthropic Messages body as the ``/v1/chat/completions`` body it is served as
(server/anthropic/request.py): the conversation, tools and tool choices, thinking, prefills,
sampling fields, and the refusals, each a ``FieldError`` naming Anthropic's field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.anthropic.request import CountTokensRequest, MessagesRequest
from server.protocol import ChatCompletionRequest

TOOL = {"name": "add", "description": "Add", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Add 1", "cache_control": {
        "type": "ephemeral"}}, {"type": "text", "text": "and 2."}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Use add.", "signature": "x"},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "3"}]},
        {"type": "text", "text": "Go on."}]},
]


def _body(**kw):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **kw}).chat_body()


def test_the_conversation_maps_onto_chat_messages():
    body = _body(system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
                 messages=HISTORY, tools=[TOOL])
    assert body["messages"] == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": [{"type": "text", "text": "Add 1"},
                                     {"type": "text", "text": "and 2."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Calling."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    assert body["add_generation_prompt"] and not body["continue_final_message"]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "add", "description": "Add", "parameters": TOOL["input_schema"]}}]
    assert body["tool_choice"] == "auto"
    chat = ChatCompletionRequest.model_validate(body)  # the chat path takes it as it is
    assert chat.tool_set.choice == "auto" and len(chat.conversation()) == 5


@pytest.mark.parametrize("choice,chat,parallel", [
    ({"type": "auto"}, "auto", None), ({"type": "none"}, "none", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}, None)])
def test_tool_choices(choice, chat, parallel):
    body = _body(messages=HISTORY[:1], tools=[TOOL], tool_choice=choice)
    assert body["tool_choice"] == chat
    assert body.get("parallel_tool_calls") == parallel
    counted = CountTokensRequest.model_validate(
        {"model": "m", "messages": HISTORY[:1], "tools": [TOOL], "tool_choice": choice})
    assert counted.chat_body()["tool_choice"] == "none"  # counting compiles no constraint


def test_sampling_thinking_prefill_and_extras():
    body = _body(messages=[*HISTORY[:1], {"role": "assistant", "content": "The sum is"}],
                 stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=0,
                 metadata={"user_id": "u1"}, stream=True, seed=7,
                 thinking={"type": "enabled", "budget_tokens": 2048},
                 output_config={"format": {"type": "json_schema", "schema": {
                     "type": "object"}}, "effort": "low"},
                 chat_template_kwargs={"x": 1})
    assert body["continue_final_message"] and not body["add_generation_prompt"]
    assert body["messages"][-1] == {"role": "assistant", "content": "The sum is"}
    assert (body["stop"], body["temperature"], body["top_p"], body["user"], body["seed"]) == \
        (["\n\n"], 0.5, 0.9, "u1", 7)
    assert "top_k" not in body and body["stream"] is True and body["max_tokens"] == 5
    assert body["chat_template_kwargs"] == {"x": 1, "enable_thinking": True}
    assert body["thinking_token_budget"] == 2048
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    off = _body(messages=HISTORY[:1], thinking={"type": "disabled"})
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert off["include_reasoning"] is False
    assert "chat_template_kwargs" not in _body(messages=HISTORY[:1])


def test_a_failed_tool_result_says_so():
    messages = [*HISTORY[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
         "is_error": True}]}]
    assert _body(messages=messages)["messages"][-1]["content"] == "Error: boom"


@pytest.mark.parametrize("fields,where", [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": HISTORY[:2]}, "messages.1"),
    ({"messages": HISTORY[:1], "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools.0.type"),
    ({"messages": HISTORY[:1], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": HISTORY[:1], "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": HISTORY[:1], "output_config": {"format": {"type": "regex"}}},
     "output_config.format"),
])
def test_refusals_name_the_field(fields, where):
    with pytest.raises(ValidationError) as info:  # a 400, never a 500
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **fields})
    assert where in str(info.value)


def test_max_tokens_is_required_but_not_for_counting():
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesRequest.model_validate({"model": "m", "messages": HISTORY[:1]})
    body = CountTokensRequest.model_validate({"model": "m", "messages": HISTORY[:1]}).chat_body()
    assert "max_tokens" not in body
