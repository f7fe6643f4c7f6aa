"""The Messages API through the real server and AsyncEngine over a fake core whose output is
known exactly (one character a token, tests/server/fakes.py), read with the real ``anthropic``
SDK: a thought and its answer split exactly into a ``thinking`` and a ``text`` block, whole and
streamed (no delta carries a marker), a tool call after a thought, a stop sequence, a prompt
that opens the thought, thinking disabled or its display omitted, and failures: an engine error
mid-stream is an ``error`` event, a draining server a 529 ``overloaded_error``."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import begin_drain, build_app
from server.config_file import ServerSettings
from tests.server.fakes import FAIL_PROMPT, FakeCore, FakeTokenizer
from tests.server.helpers import ServerThread

THOUGHT = "<think>The user asks for France's capital.</think>\n\nParis.#"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


class _OpensThought(FakeTokenizer):
    """A template that ends the prompt with an open thought (DeepSeek-R1's way)."""

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True,
                            **kwargs) -> str:
        return super().apply_chat_template(conversation, tokenize,
                                           add_generation_prompt) + "<think>\n"


def _server(script: str, tokenizer=None):
    core = FakeCore(max_model_len=4096)
    core.script = script
    if tokenizer is not None:
        core.tokenizer = tokenizer
    srv = ServerThread(build_app(AsyncEngine(core=core),
                                 ServerSettings(reasoning_parser="qwen3")))
    srv.client = anthropic.Anthropic(base_url=srv.url, api_key="-", max_retries=0)
    return srv


@pytest.fixture(scope="module")
def thinker():
    with _server(THOUGHT) as srv:
        yield srv


def _ask(srv, **kw):
    args = dict(model="fake-model", messages=ASK, max_tokens=len(THOUGHT),
                stop_sequences=["#"])
    args.update(kw)
    return srv.client.messages.create(**args)


def test_the_thought_is_a_thinking_block_before_the_text(thinker):
    m = _ask(thinker)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "The user asks for France's capital."
    assert m.content[0].signature
    assert m.content[1].text == "Paris."
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "#")
    assert m.usage.output_tokens == len(THOUGHT)


def test_streamed_blocks_split_alike_and_carry_no_marker(thinker):
    whole = _ask(thinker)
    with thinker.client.messages.stream(model="fake-model", messages=ASK,
                                        max_tokens=len(THOUGHT), stop_sequences=["#"]) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    thinking = [e.delta.thinking for e in deltas if e.delta.type == "thinking_delta"]
    text = [e.delta.text for e in deltas if e.delta.type == "text_delta"]
    assert "".join(thinking) == whole.content[0].thinking
    assert "".join(text) == "Paris."
    assert not any("<" in piece or "think>" in piece for piece in thinking + text)
    assert {e.index for e in deltas if e.delta.type == "thinking_delta"} == {0}
    assert {e.index for e in deltas if e.delta.type == "text_delta"} == {1}
    signatures = [e.delta.signature for e in deltas if e.delta.type == "signature_delta"]
    assert signatures == [whole.content[0].signature]
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_thinking_disabled_drops_the_thought_and_omitted_empties_it(thinker):
    off = _ask(thinker, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "Paris."
    hidden = _ask(thinker, thinking={"type": "enabled", "budget_tokens": 1024,
                                     "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    assert hidden.content[0].signature
    with thinker.client.messages.stream(model="fake-model", messages=ASK,
                                        max_tokens=len(THOUGHT), stop_sequences=["#"],
                                        thinking={"type": "adaptive",
                                                  "display": "omitted"}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
    assert "thinking_delta" not in kinds and kinds.count("signature_delta") == 1


def test_a_prompt_that_opens_the_thought_is_followed():
    script = "Thinking it over.</think>Paris.#"
    with _server(script, _OpensThought()) as srv:
        m = _ask(srv, max_tokens=len(script))
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in m.content] == [("thinking", "Thinking it over."), ("text", "Paris.")]


def test_a_tool_call_after_the_thought():
    script = ('<think>I need the weather tool.</think>\n<tool_call>\n{"name": "weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>#')
    with _server(script) as srv:
        m = _ask(srv, tools=[WEATHER], max_tokens=len(script))
        assert [b.type for b in m.content] == ["thinking", "tool_use"]
        assert m.content[1].name == "weather" and m.content[1].input == {"city": "Paris"}
        assert m.stop_reason == "tool_use" and m.stop_sequence is None
        with srv.client.messages.stream(model="fake-model", messages=ASK, tools=[WEATHER],
                                        max_tokens=len(script), stop_sequences=["#"]) as s:
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "tool_use"]
        assert final.content[1].input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"


def test_an_engine_failure_mid_stream_is_an_error_event(thinker):
    bad = [{"role": "user", "content": f"{FAIL_PROMPT} please"}]
    with pytest.raises(anthropic.APIStatusError) as info:
        with thinker.client.messages.stream(model="fake-model", messages=bad,
                                            max_tokens=5) as s:
            list(s)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "api_error"
    assert "secret internals" not in str(info.value.body)
    with pytest.raises(anthropic.InternalServerError) as info:
        _ask(thinker, messages=bad, max_tokens=5)
    assert info.value.body["error"]["type"] == "api_error"


def test_a_draining_server_is_overloaded():
    core = FakeCore(max_model_len=4096)
    app = build_app(AsyncEngine(core=core))
    with ServerThread(app) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="-", max_retries=0)
        begin_drain(app)
        with pytest.raises(anthropic.OverloadedError) as info:
            client.messages.create(model="fake-model", messages=ASK, max_tokens=3)
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
        assert info.value.response.headers.get("retry-after")


def test_max_tokens_past_the_context_window_is_a_cap():
    core = FakeCore(max_model_len=96)
    with ServerThread(build_app(AsyncEngine(core=core))) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="-", max_retries=0)
        m = client.messages.create(model="fake-model", messages=ASK, max_tokens=20000)
        assert m.stop_reason == "model_context_window_exceeded"
        assert m.usage.input_tokens + m.usage.output_tokens == 96
        assert client.messages.create(model="fake-model", messages=ASK,
                                      max_tokens=3).stop_reason == "max_tokens"
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="fake-model", max_tokens=5, messages=[
                {"role": "user", "content": "x" * 200}])
        assert info.value.body["error"]["type"] == "invalid_request_error"


def test_openapi_documents_anthropic_errors_on_these_routes(thinker):
    schema = httpx.get(f"{thinker.url}/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/AnthropicErrorResponse")
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse")


def test_a_body_too_large_is_request_too_large():
    app = build_app(AsyncEngine(core=FakeCore(max_model_len=4096)),
                    ServerSettings(max_request_body_size=2000))
    with ServerThread(app) as srv:
        r = httpx.post(f"{srv.url}/v1/messages", json={
            "model": "fake-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "request_too_large"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={  # other routes keep OpenAI's
            "model": "fake-model", "messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 413 and "param" in r.json()["error"]


@pytest.mark.parametrize("fields,named", [
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "t", "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}},
     "tool_choice.name"),
])
def test_the_chat_paths_refusals_use_anthropics_names(thinker, fields, named):
    r = httpx.post(f"{thinker.url}/v1/messages", json={
        "model": "fake-model", "max_tokens": 3, "messages": ASK, **fields})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(named), body
