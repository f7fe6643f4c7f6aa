"""Error paths over a real uvicorn server with a fake core (exact and quick): every status in
OpenAI's error shape, while a long stream in flight still completes; the API key; a full queue;
a dead engine; a 500 without traceback; a client disconnect that aborts its request."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, assert_error, sample, scrape
from tests.support.sse_events import parse_events


def _serve(core: FakeCore, **settings):
    return ServerThread(build_app(AsyncEngine(core=core), ServerSettings(**settings)))


def _wait_until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


BAD_COMPLETIONS = [  # (body, status, param, message fragment)
    ({}, 400, "prompt", "required"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", ""),
    ({"prompt": "x", "n": 0}, 400, "n", ""),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", ""),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ""),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ({"prompt": 3}, 400, "prompt", "list of token ids"),
    ({"prompt": [-1]}, 400, None, ""),
    ({"prompt": [9_999_999]}, 400, "prompt", "vocabulary"),
    ({"prompt": "x" * 250, "max_tokens": 10}, 400, "prompt", "maximum context length is 256"),
    ({"prompt": "x", "stop": 5}, 400, "stop", ""),
    ({"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, None, "min_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages", ""),
    ({"messages": [{"role": "bogus", "content": "x"}]}, 400, "messages.0.role", ""),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]}, 400,
     "messages.0.tool_call_id", "matches no tool call"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content", "image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, "messages.0.content", "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "ftp://x/y.png"}}]}]}, 400, "messages.0.content.0.image_url.url", "data: URL"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", "chat template"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None,
     "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools.0.function", "name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, 400, "tools.0.function.parameters",
     "object"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name", "not one of"),
]


def test_every_error_shape_while_a_long_stream_completes():
    core = FakeCore(step_delay=0.003)
    with _serve(core) as srv:
        result: dict = {}

        def long_stream() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60, json={
                    "prompt": "long", "max_tokens": 200, "stream": True}) as r:
                result["body"] = r.read().decode()

        t = threading.Thread(target=long_stream)
        t.start()
        _wait_until(lambda: core.generation_tokens > 0)
        core.pause()  # hold the stream mid-flight while the bad requests come in
        for body, status, param, frag in BAD_COMPLETIONS:
            assert_error(httpx.post(f"{srv.url}/v1/completions", json=body), status,
                         param=param, contains=frag)
        for body, status, param, frag in BAD_CHATS:
            assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json=body), status,
                         param=param, contains=frag)
        assert_error(httpx.post(f"{srv.url}/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"}), 400,
                     contains="not valid JSON")
        assert_error(httpx.get(f"{srv.url}/nope"), 404, contains="no route")
        assert_error(httpx.get(f"{srv.url}/v1/completions"), 405)
        assert_error(httpx.post(f"{srv.url}/detokenize", json={"tokens": [10**7]}), 400,
                     param="tokens")
        assert not core.aborted  # no bad request disturbed the engine
        assert len(core.requests) == 1  # the long stream, still in flight
        core.resume()
        t.join(60)
        events = parse_events(result["body"])
        assert events[-1] == "[DONE]"
        assert len("".join(e["choices"][0]["text"] for e in events[:-1])) == 200
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_api_key_guards_v1_but_not_health_or_metrics():
    with _serve(FakeCore(), api_key="sekret") as srv:
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401, code="invalid_api_key")
        assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"},
                                headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.post(f"{srv.url}/tokenize", json={"prompt": "x"}), 401)
        ok = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        assert httpx.get(f"{srv.url}/version").status_code == 200


def test_full_queue_answers_503_with_retry_after():
    core = FakeCore(max_waiting_requests=2)
    with _serve(core) as srv:
        core.pause()
        with httpx.Client(base_url=srv.url, timeout=60) as c1, \
                httpx.Client(base_url=srv.url, timeout=60) as c2:
            body = {"prompt": "q", "max_tokens": 3, "stream": True}
            with c1.stream("POST", "/v1/completions", json=body) as r1, \
                    c2.stream("POST", "/v1/completions", json=body) as r2:
                assert r1.status_code == r2.status_code == 200
                r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "q"})
                assert_error(r, 503, code="queue_full")
                assert int(r.headers["retry-after"]) >= 1
                core.resume()
                for resp in (r1, r2):
                    events = parse_events(resp.read().decode())
                    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
        m = scrape(srv.url)
        assert sample(m, "kvserve:request_rejected_total", reason="queue_full") == 1


def test_dead_engine_reports_in_stream_then_health_is_503():
    core = FakeCore()
    with _serve(core) as srv:
        core.allow(1)
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 50, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert '"text":"a"' in first
            core.fail_next_step = RuntimeError("secret internals")
            core.resume()
            events = parse_events("\n\n".join(line for line in lines if line) + "\n\n")
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_dead"
        assert "secret" not in events[-2]["error"]["message"]
        assert httpx.get(f"{srv.url}/health").status_code == 503
        assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}), 503,
                     code="engine_dead")
        assert sample(scrape(srv.url), "kvserve:engine_healthy") == 0


class _ExplodingTokenizer:
    def encode(self, *a, **k):
        raise RuntimeError("secret internals")


def test_unexpected_error_is_a_500_without_traceback(monkeypatch):
    core = FakeCore()
    engine = AsyncEngine(core=core)
    with ServerThread(build_app(engine)) as srv:
        monkeypatch.setattr(engine, "tokenizer", _ExplodingTokenizer())
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"},
                       headers={"X-Request-Id": "req-500"})
        err = assert_error(r, 500)
        assert "secret" not in err["message"] and "req-500" in err["message"]
        assert r.headers["x-request-id"] == "req-500"
        monkeypatch.undo()
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.json()["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 100, "stream": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 100, "stream": True}),
])
def test_client_disconnect_aborts_and_frees_blocks(path, body):
    core = FakeCore()
    with _serve(core) as srv:
        core.allow(2)
        engine = srv.server.config.app.state.engine
        if body.get("stream"):
            with httpx.Client(timeout=60) as client, \
                    client.stream("POST", f"{srv.url}{path}", json=body) as r:
                # the first token "a" (not the chat role chunk, whose "assistant" starts "a too)
                next(line for line in r.iter_lines()
                     if re.search(r'"(content|text)": ?"a', line))
            # leaving the block closes the connection: the client is gone
        else:  # no headers before the end: send by hand, then hang up mid-generation
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                payload = json.dumps(body).encode()
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                             .encode() + payload)
                _wait_until(lambda: core.steps == 2)
        # The engine is held inside a step (or about to be: it may still be in the last step it
        # was allowed when the client hangs up, and then takes the abort before blocking). The
        # abort must be queued or taken before it may go on, or the request could finish first.
        _wait_until(lambda: bool(engine._aborts) or bool(core.aborted))
        core.resume()
        _wait_until(lambda: len(core.aborted) == 1)
        assert core.blocks_used == 0 and core.generation_tokens < 100
        _wait_until(lambda: sample(scrape(srv.url), "kvserve:request_success_total",
                                   finished_reason="abort") == 1)
