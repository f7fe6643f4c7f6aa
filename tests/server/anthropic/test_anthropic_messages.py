"""The Anthropic Messages API end to end: ``kvserve serve`` on a tiny random model (a byte
tokenizer whose chat template writes ``<think>`` markers, Qwen3's way: a thought opened in the
prompt unless ``enable_thinking`` is false, the server's default here) with ``--api-key``, and
the real ``anthropic`` SDK. ``messages.create`` and ``messages.stream`` agree at temperature 0;
a forced tool call comes back as a ``tool_use`` block with its input parsed, and its
``tool_result`` is served; ``thinking`` enabled gives a ``thinking`` block first; stop sequences,
prefills, the prefix cache's ``cache_read_input_tokens``; ``count_tokens`` counts what
``/v1/chat/completions`` does; every failure is an Anthropic-shaped error the SDK raises as
its own class; ``x-api-key`` and ``Authorization: Bearer`` both authenticate."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from engine.loading.tiny import byte_tokenizer, make_tiny_model_dir
from tests.server.helpers import start_server_process

pytestmark = pytest.mark.slow
KEY = "anthropic-key"
MODEL = "tiny-thinker"
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {
               # an enum: a random model's free strings hold control characters, which the
               # tool-call grammar lets through but JSON (so the call parser) refuses
               "city": {"enum": ["Paris", "Rome", "Oslo"]},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    model = make_tiny_model_dir(tmp / "tiny", "llama", seed=3, max_position_embeddings=4096)
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", str(model), "--served-model-name", MODEL,
         "--max-model-len", "4096", "--kv-cache-memory", "32MiB", "--api-key", KEY,
         "--default-chat-template-kwargs", '{"enable_thinking": false}'],
        tmp / "server.log", timeout=300)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


# This SDK's create() no longer takes temperature (newer models refuse it); the server does.
GREEDY = {"temperature": 0}


def _create(client, **kw):
    args = dict(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    args.update(kw)
    return client.messages.create(**args)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_gives_a_message(client):
    m = _create(client, system="You are terse.")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 16
    assert m.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=MODEL, messages=ASK, system="You are terse.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens


def test_stream_accumulates_to_the_created_message(client):
    kw = dict(system=[{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}],
              max_tokens=24)
    whole = _create(client, **kw)
    with client.messages.stream(model=MODEL, messages=ASK, extra_body=GREEDY, **kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds and "content_block_stop" in kinds


def test_raw_stream_has_anthropics_event_types(server):
    r = httpx.post(f"{server}/v1/messages", headers={"x-api-key": KEY,
                                                     "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "max_tokens": 6, "messages": ASK, "stream": True},
                   timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
             if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                       "message_stop"]
    assert "[DONE]" not in r.text
    delta = datas[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6


def test_stop_sequences_end_the_output(client):
    text = _text(_create(client, max_tokens=24))
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1)
                 if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    if stop is None:
        pytest.skip(f"no printable ASCII pair in the output {text!r}")
    m = _create(client, max_tokens=24, stop_sequences=[stop, "\x01never"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == text[:text.index(stop)]


def test_a_prefill_is_continued(client):
    m = _create(client, messages=[*ASK, {"role": "assistant", "content": "The weather is"}],
                max_tokens=4)
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert not _text(m).startswith("The weather is")


def test_the_prefix_cache_is_reported_as_cache_reads(client):
    long = [{"role": "user", "content": "Tell me about the weather. " * 12}]
    first = _create(client, messages=long, max_tokens=2)
    again = _create(client, messages=long, max_tokens=2)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_tool_round_trip(client, choice):
    m = _create(client, tools=[WEATHER], tool_choice=choice, max_tokens=120)
    assert m.stop_reason == "tool_use", m.content
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and m.content[-1] is uses[0]
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert isinstance(use.input, dict)
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=120, messages=ASK, extra_body=GREEDY,
                                tools=[WEATHER], tool_choice=choice) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(use.name, use.input)]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"},
                   {"type": "text", "text": "Thanks. Summarise."}]}]
    final = _create(client, messages=history, tools=[WEATHER], tool_choice={"type": "none"},
                    max_tokens=8)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"]
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    m = _create(client, max_tokens=40,
                output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn", m.content
    jsonschema.validate(json.loads(_text(m)), schema)


def test_thinking_comes_back_as_thinking_blocks(client):
    m = _create(client, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=12)
    assert m.content[0].type == "thinking", m
    assert isinstance(m.content[0].signature, str) and m.content[0].signature
    assert m.stop_reason == "max_tokens"  # a random model never closes its thought
    with client.messages.stream(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    thought = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    assert thought == m.content[0].thinking == final.content[0].thinking
    assert [d.signature for d in deltas if d.type == "signature_delta"] == \
        [m.content[0].signature]
    off = _create(client, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_budget_tokens_bounds_the_thought(client):
    m = _create(client, thinking={"type": "enabled", "budget_tokens": 5}, max_tokens=24)
    assert [b.type for b in m.content][:1] == ["thinking"], m.content
    thought = m.content[0].thinking
    assert len(thought) <= 5  # a token a byte (a stray byte decodes to one U+FFFD)
    assert m.content[-1].type == "text"  # the answer followed the forced marker


def test_count_tokens_counts_the_chat_prompt(client, server):
    chat = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "max_tokens": 1, "messages": [
                          {"role": "system", "content": "Be brief."}, *ASK],
                          "tools": [{"type": "function", "function": {
                              "name": WEATHER["name"], "description": WEATHER["description"],
                              "parameters": WEATHER["input_schema"]}}]}, timeout=120)
    assert chat.status_code == 200, chat.text
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK,
                                           tools=[WEATHER])
    assert counted.input_tokens == chat.json()["usage"]["prompt_tokens"]
    plain = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert plain.input_tokens < counted.input_tokens


def _refused(call, cls, kind):
    with pytest.raises(cls) as info:
        call()
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == kind
    assert info.value.body["error"]["message"]
    return info.value


def test_errors_are_anthropic_shaped(client):
    bad = anthropic.BadRequestError
    err = _refused(lambda: client.messages.create(model=MODEL, max_tokens=anthropic.NOT_GIVEN,
                                                  messages=ASK), bad, "invalid_request_error")
    assert "max_tokens" in err.body["error"]["message"]
    _refused(lambda: _create(client, messages=[{"role": "system", "content": "hi"}]), bad,
             "invalid_request_error")
    _refused(lambda: _create(client, model="claude-nope"), anthropic.NotFoundError,
             "not_found_error")
    _refused(lambda: _create(client, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]), bad,
             "invalid_request_error")
    _refused(lambda: _create(client, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]), bad,
             "invalid_request_error")
    _refused(lambda: _create(client, tools=[{"type": "web_search_20250305",
                                             "name": "web_search"}]), bad,
             "invalid_request_error")
    _refused(lambda: _create(client, tools=[WEATHER], tool_choice={"type": "tool",
                                                                   "name": "nope"}), bad,
             "invalid_request_error")
    _refused(lambda: _create(client, extra_body={"temperature": 1.5}), bad,
             "invalid_request_error")
    _refused(lambda: client.messages.count_tokens(model="claude-nope", messages=ASK),
             anthropic.NotFoundError, "not_found_error")
    assert _create(client, max_tokens=1).stop_reason == "max_tokens"  # still serving


def test_auth_takes_x_api_key_or_bearer(client, server):
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    _refused(lambda: _create(wrong), anthropic.AuthenticationError, "authentication_error")
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)
    assert _create(bearer, max_tokens=1).stop_reason == "max_tokens"
    r = httpx.post(f"{server}/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{server}/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
    # x-api-key is this API's header only: the OpenAI routes keep Authorization: Bearer
    r = httpx.get(f"{server}/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 401
