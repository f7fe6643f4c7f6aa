"""Chat completions over a fake core whose output is known exactly (one character a token),
read by the OpenAI SDK: a call cut by ``max_tokens`` comes back as OpenAI's partial call
(``tool_calls[0].function.arguments`` a prefix of the arguments, ``content`` None,
``finish_reason`` "length"; no markup anywhere), streamed or not; streamed arguments arrive
piece by piece and concatenate to the non-streamed ones."""

from __future__ import annotations

import json

import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ARGS = '{"a": 12, "b": 30}'
SCRIPT = f'<tool_call>\n{{"name": "add", "arguments": {ARGS}}}\n</tool_call>#'
NAME_END = SCRIPT.index('"add"') + len('"add"')
ARGS_AT = SCRIPT.index(ARGS)


@pytest.fixture(scope="module")
def client():
    core = FakeCore(max_model_len=4096, step_delay=0.005)  # a stream may merge quicker steps
    core.script = SCRIPT
    with ServerThread(build_app(AsyncEngine(core=core), ServerSettings())) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)


def create(client, max_tokens, **kw):
    return client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "add"}], tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}}, stop=["#"],
        max_tokens=max_tokens, **kw)


def assembled(chunks):
    calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": None, "pieces": []})
            if part.id:
                assert call["id"] is None and part.type == "function"
                assert part.function.arguments == ""  # the head: id, name, no arguments
                call["id"], call["name"] = part.id, part.function.name
            elif part.function.arguments:
                call["pieces"].append(part.function.arguments)
    return content, [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


def test_a_whole_call_streams_its_arguments_piece_by_piece(client):
    r = create(client, 200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == ARGS
    content, [call], finish = assembled(list(create(client, 200, stream=True)))
    assert content == "" and finish == "tool_calls" and call["name"] == "add"
    assert len(call["pieces"]) > 1 and "".join(call["pieces"]) == ARGS


@pytest.mark.parametrize("cut", [ARGS_AT + 1, ARGS_AT + 8, ARGS_AT + len(ARGS) - 1])
def test_a_call_cut_inside_its_arguments_is_a_partial_call(client, cut):
    choice = create(client, cut).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "add"
    assert call.function.arguments == ARGS[:cut - ARGS_AT]
    content, [streamed], finish = assembled(list(create(client, cut, stream=True)))
    assert content == "" and finish == "length" and streamed["name"] == "add"
    assert "".join(streamed["pieces"]) == call.function.arguments


def test_a_call_cut_after_its_name_has_empty_arguments(client):
    choice = create(client, NAME_END + 3).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("add", "")


@pytest.mark.parametrize("cut", [3, NAME_END - 2])
def test_a_call_cut_before_its_name_is_no_call_and_no_markup(client, cut):
    choice = create(client, cut).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and choice.message.tool_calls is None
    content, calls, finish = assembled(list(create(client, cut, stream=True)))
    assert (content, calls, finish) == ("", [], "length")


def test_the_whole_call_parses_as_json_and_a_cut_one_is_its_prefix(client):
    whole = json.loads(create(client, 200).choices[0].message.tool_calls[0].function.arguments)
    part = create(client, ARGS_AT + 10).choices[0].message.tool_calls[0].function.arguments
    assert json.dumps(whole).startswith(part)
