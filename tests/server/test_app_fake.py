"""The HTTP layer over a real uvicorn server and the real AsyncEngine, with a fake core so that
outputs are known exactly ("abcde..."): response shapes as the OpenAI SDK parses them, SSE
framing, choice indices, echo/logprobs shapes, and the usage accounting."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread
from tests.support.sse_events import parse_events


@pytest.fixture(scope="module")
def fake_server():
    core = FakeCore()
    engine = AsyncEngine(core=core)
    with ServerThread(build_app(engine, ServerSettings())) as srv:
        srv.core = core
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield srv
    core.resume()


def test_completion_matches_openai_shape(fake_server):
    r = fake_server.client.completions.create(model="fake-model", prompt="Hi!", max_tokens=5)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "fake-model"
    assert [c.text for c in r.choices] == ["abcde"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_with_usage(fake_server):
    chunks = list(fake_server.client.completions.create(
        model="fake-model", prompt="Hi!", max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "abcde"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_raw_sse_framing_ends_with_done(fake_server):
    with httpx.stream("POST", f"{fake_server.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 3, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = body.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    events = parse_events(body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"


def test_several_prompts_and_n_give_ordered_choices_and_usage_per_prompt(fake_server):
    r = fake_server.client.completions.create(model="fake-model", prompt=["ab", "FGH"],
                                              max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == "ab" for c in r.choices)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    stream = fake_server.client.completions.create(
        model="fake-model", prompt=["ab", "cd"], max_tokens=2, n=2, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "ab", 1: "ab", 2: "ab", 3: "ab"}


def test_stop_string_and_echo(fake_server):
    r = fake_server.client.completions.create(model="fake-model", prompt="Q:", max_tokens=10,
                                              stop=["d"], echo=True)
    assert r.choices[0].text == "Q:abc" and r.choices[0].finish_reason == "stop"


def test_completion_logprobs_shape(fake_server):
    r = fake_server.client.completions.create(model="fake-model", prompt="Q", max_tokens=3,
                                              logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["a", "b", "c"] and lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs[0] == {"a": -0.5, "b": -2.0}  # the 2 most likely


def test_chat_stream_opens_with_role_and_has_chat_logprobs(fake_server):
    chunks = list(fake_server.client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True, logprobs=True, top_logprobs=1, stream_options={"include_usage": True}))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "abc"
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == ["a", "b", "c"]
    assert [len(t.top_logprobs) for t in tokens] == [1, 1, 1] and tokens[0].bytes == [97]
    assert chunks[-1].usage.prompt_tokens == len("<user>hi<assistant>")


def test_chat_non_stream_n2(fake_server):
    r = fake_server.client.chat.completions.create(
        model="fake-model", messages=[{"role": "system", "content": "s"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "hi"}]}],
        max_completion_tokens=4, n=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content) for c in r.choices] == \
        [(0, "assistant", "abcd"), (1, "assistant", "abcd")]
    assert r.usage.completion_tokens == 8


def test_models_version_tokenize_detokenize(fake_server):
    models = fake_server.client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert httpx.get(f"{fake_server.url}/version").json()["version"]
    tok = httpx.post(f"{fake_server.url}/tokenize", json={"prompt": "hey"}).json()
    assert tok["tokens"] == [104, 101, 121] and tok["count"] == 3
    assert tok["max_model_len"] == 256
    chat = httpx.post(f"{fake_server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["count"] == len("<user>x<assistant>")
    assert httpx.post(f"{fake_server.url}/detokenize",
                      json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


def test_request_id_is_echoed_or_generated(fake_server):
    r = httpx.get(f"{fake_server.url}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(f"{fake_server.url}/v1/models")
    assert len(r.headers["x-request-id"]) == 32
    r = httpx.get(f"{fake_server.url}/v1/models", headers={"X-Request-Id": "bad id\x01"})
    assert r.headers["x-request-id"] != "bad id\x01"


def test_models_retrieve_by_id(fake_server):
    m = fake_server.client.models.retrieve("fake-model")
    assert (m.id, m.object, m.owned_by) == ("fake-model", "model", "kvserve")
    for name in ("gpt-4", "org/fake-model"):
        with pytest.raises(openai.NotFoundError) as info:
            fake_server.client.models.retrieve(name)
        err = info.value.body
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert name in err["message"]


TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}
TOOL_HISTORY = [
    {"role": "user", "content": "add 1"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "1"},
]


def test_tool_choice_none_renders_the_tools_and_parses_nothing():
    from server.tools.formats import HERMES
    from server.tools.prompt import tool_conversation
    from tests.server.fakes import FakeTokenizer

    engine = AsyncEngine(core=FakeCore(max_model_len=2048))
    with ServerThread(build_app(engine, ServerSettings())) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="fake-model", messages=TOOL_HISTORY, tools=[TOOL], tool_choice="none",
            max_tokens=3)
    assert r.choices[0].message.content == "abc" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length"
    conv = [{"role": "user", "content": "add 1"},
            {"role": "assistant", "content": "", "tool_calls": TOOL_HISTORY[1]["tool_calls"]},
            {"role": "tool", "content": "1", "tool_call_id": "call_1"}]
    msgs, _ = tool_conversation(conv, [TOOL], HERMES, native=False)
    expected = FakeTokenizer().apply_chat_template(msgs)
    assert r.usage.prompt_tokens == len(expected)
    assert "<tool_call>" in expected and "<tool_response>" in expected


SCRIPT = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>#'


@pytest.fixture()
def scripted_server():
    core = FakeCore(max_model_len=4096)
    core.script = SCRIPT
    with ServerThread(build_app(AsyncEngine(core=core), ServerSettings())) as srv:
        srv.core = core
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield srv


def test_tool_calls_are_parsed_whole_and_streamed(scripted_server):
    client, core = scripted_server.client, scripted_server.core
    args = dict(model="fake-model", messages=[{"role": "user", "content": "add 1"}],
                tools=[TOOL], stop=["#"], max_tokens=200)
    r = client.chat.completions.create(**args)
    assert core.structured.specs[-1].kind == "structural_tag"
    choice = r.choices[0]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 1}')
    chunks = list(client.chat.completions.create(**args, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Sure."  # one character a step: the marker was held back, then dropped
    parts = [p for c in chunks for p in c.choices[0].delta.tool_calls or ()]
    # the head first, then the arguments piece by piece (a step's tokens per delta)
    assert len(parts) >= 2 and all(p.index == 0 for p in parts)
    assert parts[0].id.startswith("call_") and parts[0].type == "function"
    assert (parts[0].function.name, parts[0].function.arguments) == ("add", "")
    assert all(p.id is None for p in parts[1:])
    assert "".join(p.function.arguments for p in parts[1:]) == '{"a": 1}'
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    n = len(core.structured.specs)
    r = client.chat.completions.create(**args, tool_choice="none")
    assert len(core.structured.specs) == n  # none: no constraint, no parsing
    assert r.choices[0].message.content == SCRIPT[:-1] and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_auto_tool_choice_can_be_turned_off():
    engine = AsyncEngine(core=FakeCore(max_model_len=2048))
    with ServerThread(build_app(engine, ServerSettings(enable_auto_tool_choice=False))) as srv:
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200, r.text


def test_several_calls_and_several_choices_stream_apart(scripted_server):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    scripted_server.core.script = f"{call % 1}\n{call % 2}#"
    args = dict(model="fake-model", messages=[{"role": "user", "content": "add"}],
                tools=[TOOL], stop=["#"], max_tokens=200, n=2)
    r = scripted_server.client.chat.completions.create(**args)
    for choice in r.choices:
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert [c.function.arguments for c in choice.message.tool_calls] == ['{"a": 1}',
                                                                             '{"a": 2}']
    calls: dict[tuple[int, int], str] = {}
    finish = {}
    for chunk in scripted_server.client.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.content
            for part in ch.delta.tool_calls or ():
                key = (ch.index, part.index)
                calls[key] = calls.get(key, "") + (part.function.arguments or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert calls == {(i, j): f'{{"a": {j + 1}}}' for i in range(2) for j in range(2)}
    assert finish == {0: "tool_calls", 1: "tool_calls"}


def test_mistral_calls_in_one_array_with_mistral_ids():
    """--tool-call-parser mistral: one [TOOL_CALLS] array of two calls is two calls with ids of
    9 letters and digits; streamed, nothing of the array reaches the content; the output is
    decoded with special tokens kept ([TOOL_CALLS] is one)."""
    core = FakeCore(max_model_len=4096)
    core.script = ('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                   '{"name": "add", "arguments": {"a": 2}}]#')
    seen = []
    add_request = core.add_request

    def recording(rid, ids, params, **kw):
        seen.append(params)
        return add_request(rid, ids, params, **kw)

    core.add_request = recording
    app = build_app(AsyncEngine(core=core), ServerSettings(tool_call_parser="mistral"))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        args = dict(model="fake-model", messages=[{"role": "user", "content": "add"}],
                    tools=[TOOL], stop=["#"], max_tokens=200)
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
        assert [c.function.arguments for c in choice.message.tool_calls] == ['{"a": 1}',
                                                                             '{"a": 2}']
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
        assert seen[-1].skip_special_tokens is False
        chunks = list(client.chat.completions.create(**args, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure."
        parts = [p for c in chunks for p in c.choices[0].delta.tool_calls or ()]
        assert [p.index for p in parts] == [0, 0, 1, 1]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        client.chat.completions.create(**args, tool_choice="none")
        assert seen[-1].skip_special_tokens is True  # no calls expected: as asked
