"""Property-based fuzzing of the real app (a real engine on a tiny random model, a real uvicorn
server on a loopback port): random completions and chat bodies built from the request schema —
wrong types, huge and negative numbers, NaN and infinities, unicode edge cases (lone
surrogates, NUL, right-to-left marks), huge lists, unknown fields — must never get a 5xx, every
error must come in OpenAI's shape, and afterwards the server is healthy with no KV block in use.
The server runs kvserve's connection layer (server/connections.py): raw bytes on a socket —
requests cut anywhere (slowloris), garbage, a stream never read — always get an answer in
OpenAI's shape or a silent close, within the header/body timeouts, never a hung socket.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from server.config_file import ServerSettings
from server.connections import protocol_class
from tests.server.helpers import ServerThread

pytestmark = pytest.mark.slow  # ~2 minutes: hundreds of requests, the valid ones generate

WEIRD_TEXT = ["", "\ud800", "a\udfffb", "\x00", "\u202e\u200b", "🦀" * 50, "x" * 5000,
              "<s>user\n", "</s>", "\ufffd"]
NUMBERS = [0, -1, 1, 2, 7, 2**31, -(2**31), 2**63, -(2**63) - 1, 10**30, 0.5, -0.5, 1e308,
           float("nan"), float("inf"), float("-inf")]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(-300, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WEIRD_TEXT),
    st.text(max_size=20))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
token_lists = st.one_of(st.lists(st.integers(-5, 300), max_size=40),
                        st.lists(st.sampled_from([0, 1, 255, 259, 260, 10**9, -1]), max_size=5),
                        st.just(list(range(256)) * 8))  # a huge prompt
prompts = st.one_of(st.sampled_from(WEIRD_TEXT), st.text(max_size=40), token_lists,
                    st.lists(st.text(max_size=10), max_size=4),
                    st.lists(token_lists, max_size=3), json_values)

SAMPLING = {
    "model": st.one_of(st.just("tiny"), st.sampled_from(WEIRD_TEXT), json_values),
    "max_tokens": st.one_of(st.integers(-2, 8), st.sampled_from(NUMBERS), json_values),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from(NUMBERS), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from(NUMBERS)),
    "top_k": st.one_of(st.integers(-3, 300), st.sampled_from(NUMBERS)),
    "min_p": st.floats(-1, 2),
    "n": st.one_of(st.integers(-1, 4), st.sampled_from([0, 129, 10**6])),
    "stop": st.one_of(st.sampled_from(WEIRD_TEXT), st.lists(st.text(max_size=5), max_size=70),
                      json_values),
    "stop_token_ids": st.one_of(token_lists, json_values),
    "seed": st.one_of(st.sampled_from(NUMBERS), st.integers()),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.sampled_from(NUMBERS)),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["0", "1", "259", "260", "-1", "x",
                                                             "99999999999"]),
                                            st.one_of(st.floats(-200, 200),
                                                      st.sampled_from(NUMBERS)), max_size=5),
                            json_values),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans(), json_values),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "min_tokens": st.integers(-1, 10),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}), json_values),
    "priority": st.integers(-3, 3), "cache_salt": st.sampled_from(WEIRD_TEXT),
    "user": st.sampled_from(WEIRD_TEXT), "skip_special_tokens": json_values,
}
completion_bodies = st.fixed_dictionaries(
    {}, optional={"prompt": prompts, "suffix": st.sampled_from(WEIRD_TEXT), **SAMPLING,
                  "unknown_field": json_values})
messages = st.lists(st.fixed_dictionaries(
    {}, optional={"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool",
                                                      "bogus"]), json_values),
                  "content": st.one_of(st.sampled_from(WEIRD_TEXT), st.text(max_size=30),
                                       json_values),
                  "name": st.sampled_from(WEIRD_TEXT)}), max_size=4)
chat_bodies = st.fixed_dictionaries(
    {}, optional={"messages": st.one_of(messages, json_values), **SAMPLING,
                  "top_logprobs": st.integers(-1, 25), "add_generation_prompt": json_values,
                  "chat_template_kwargs": json_values, "tools": json_values,
                  "response_format": json_values})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("fuzz") / "tiny", "llama",
                               max_position_embeddings=96)
    engine = AsyncEngine(EngineConfig(model=str(path), served_model_name="tiny",
                                      dtype="float32", device="cpu", kv_cache_memory="2MiB",
                                      max_num_seqs=8, max_waiting_requests=64,
                                      max_num_batched_tokens=128))
    app = build_app(engine, ServerSettings(header_timeout=1, body_timeout=1, stream_timeout=1))
    with ServerThread(app, http=protocol_class(app.state.connections)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as client:
        yield srv, engine, client


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:  # an error inside a stream: OpenAI's shape too
                    assert event["error"]["message"] and event["error"]["code"] < 500


def _send(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True)  # NaN/Infinity tokens, as sloppy clients send
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=completion_bodies)
def test_fuzzed_completions_never_5xx(live, body):
    _check(_send(live[2], "/v1/completions", body))


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_never_5xx(live, body):
    _check(_send(live[2], "/v1/chat/completions", body))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=64), st.sampled_from(
    [b"", b"{", b"[]", b"null", b'{"prompt": "\\ud800"}', b'{"prompt": NaN}', b"\xff\xfe",
     b'{"prompt": "a", "max_tokens": 1e999}'])),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                             "/detokenize"]))
def test_malformed_json_is_a_4xx(live, raw, path):
    _check(live[2].post(path, content=raw, headers={"Content-Type": "application/json"}))


_BODY = b'{"prompt": "hello", "max_tokens": 3}'
_VALID = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.integers(0, len(_VALID) - 1).map(lambda n: _VALID[:n]),
                     st.binary(max_size=200),
                     st.binary(max_size=40).map(lambda b: _VALID[:60] + b)),
       read=st.booleans())
def test_raw_bytes_get_an_answer_or_a_close_within_the_timeouts(live, raw, read):
    srv = live[0]
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        if not read:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(raw)
        if not read:
            time.sleep(0.5)  # a client that reads late: whatever came is still readable
        sock.settimeout(10)  # well above the 1 s timeouts
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    if data:
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        assert 400 <= status < 500, data[:300]
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_after_the_fuzz_the_server_is_healthy_and_holds_no_blocks(live):
    srv, engine, client = live
    deadline = time.monotonic() + 60
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get("/health").status_code == 200
    assert engine.stats().num_blocks_used == 0
    ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                              "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
