"""Hostile and careless clients (issue 11, the server's part), over a real uvicorn server and
the real AsyncEngine around a fake core: every bad request gets a clear 4xx in OpenAI's shape
before it reaches the engine, and no client — one that never reads, one that leaves before the
first byte, one that sends a huge body — can hold engine work or stall the event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.loading.tiny import byte_tokenizer
from engine.request_output import CompletionOutput, RequestOutput
from server.app import begin_drain, build_app
from server.cli import exposure_warning, uvicorn_config
from server.config_file import ServerSettings
from server.serving import merge_streams
from tests.server.fakes import FAIL_PROMPT, FakeCore, FakeTokenizer
from tests.server.helpers import ServerThread, assert_error
from tests.support.sse_events import parse_events

CHAT = [{"role": "user", "content": "hi"}]


def _serve(core: FakeCore, *, uvicorn_kwargs: dict | None = None, **settings) -> ServerThread:
    return ServerThread(build_app(AsyncEngine(core=core), ServerSettings(**settings)),
                        **(uvicorn_kwargs or {}))


def _wait_until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _post_raw(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    """POST ``body`` as ASCII JSON: lone surrogates travel as ``\\ud800`` escapes (httpx's own
    encoder would refuse to send them)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=30)


# ---- 1. sequences per request -------------------------------------------------------------

def test_a_batch_of_more_sequences_than_allowed_is_a_400_naming_the_limit():
    core = FakeCore(max_num_seqs=4)  # the per-request cap defaults to max_num_seqs
    with _serve(core) as srv:
        err = assert_error(httpx.post(f"{srv.url}/v1/completions", json={
            "prompt": ["a"] * 3, "n": 2, "max_tokens": 1}), 400, param="prompt",
            contains="3 prompts x n=2 = 6 sequences")
        assert "at most 4" in err["message"] and "--max-seqs-per-request" in err["message"]
        assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": CHAT, "n": 5, "max_tokens": 1}), 400, param="n",
            contains="--max-seqs-per-request")
        assert not core.requests and not core.aborted  # refused before the engine saw it
        ok = httpx.post(f"{srv.url}/v1/completions", json={
            "prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_batch_larger_than_the_whole_queue_is_a_400_not_a_retryable_503():
    core = FakeCore(max_num_seqs=4, max_seqs_per_request=64, max_waiting_requests=5)
    with _serve(core) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={
            "prompt": ["a"] * 3, "n": 2, "max_tokens": 1})
        err = assert_error(r, 400, param="prompt", contains="--max-waiting-requests")
        assert "6 sequences" in err["message"] and "at most 5" in err["message"]
        assert "retry-after" not in r.headers


# ---- 2. chat templates from requests ------------------------------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"chat_template": "{{ 'pwned' }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'pwned' }}"}},
     "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"documents": [{"text": "d"}]}},
     "chat_template_kwargs.documents"),
    ({"documents": [{"text": "d"}]}, "documents"),
])
def test_request_templates_need_the_trust_flag(extra, param):
    with _serve(FakeCore()) as srv:
        assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 1, **extra}), 400, param=param,
            contains="--trust-request-chat-template")


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("key", ["tokenize", "return_tensors", "return_dict", "tokenizer_kwargs",
                                 "add_generation_prompt", "conversation"])
def test_apply_chat_template_parameters_are_never_taken_from_a_request(key, trusted):
    with _serve(FakeCore(), trust_request_chat_template=trusted) as srv:
        assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {key: True}}), 400,
            param=f"chat_template_kwargs.{key}", contains="apply_chat_template")


def test_trusted_request_template_is_used_and_template_variables_pass():
    core = FakeCore()
    core.tokenizer = byte_tokenizer()  # a real HF tokenizer that renders the template it gets
    with _serve(core, trust_request_chat_template=True) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 1,
            "chat_template": "X{{ messages[0]['content'] }}{{ flavour }}",
            "chat_template_kwargs": {"flavour": "!"}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len("Xhi!")
    with _serve(FakeCore()) as srv:  # plain template variables need no trust
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text


# ---- 5. bounded merging, stalled readers -------------------------------------------------

class _Source:
    """A stream whose next output is always ready; counts what was pulled from it."""

    def __init__(self, rid: str, total: int) -> None:
        self.rid, self.total, self.pulled, self.aborted = rid, total, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.pulled >= self.total:
            raise StopAsyncIteration
        self.pulled += 1
        await asyncio.sleep(0)
        done = self.pulled == self.total
        return RequestOutput(self.rid, None, [1], [CompletionOutput(0, "x" * self.pulled,
                             finish_reason="length" if done else None)], finished=done)

    def abort(self) -> None:
        self.aborted = True


def test_merge_streams_holds_one_output_per_stream_while_the_consumer_stalls():
    async def scenario() -> None:
        sources = [_Source("a", 1000), _Source("b", 1000)]
        merged = merge_streams(sources)
        i, out = await merged.__anext__()
        await asyncio.sleep(0.2)  # the consumer (a client not reading) stalls
        assert sum(s.pulled for s in sources) <= 2 * len(sources)
        seen = {i: [out]}
        async for i, out in merged:
            seen.setdefault(i, []).append(out)
        assert [seen[k][-1].finished for k in (0, 1)] == [True, True]
        assert all(s.aborted for s in sources)  # a no-op for finished ones, but always asked

        sources = [_Source("c", 1000), _Source("d", 1000)]
        merged = merge_streams(sources)
        await merged.__anext__()
        await merged.aclose()  # the consumer goes away
        assert all(s.aborted for s in sources)

    asyncio.run(scenario())


def test_a_client_that_stops_reading_is_timed_out_and_its_request_aborted():
    core = FakeCore(max_model_len=4_000_000, step_delay=0.01)
    with _serve(core, stream_timeout=1.0) as srv:
        # One 3 MB event (an echoed prompt) fills the socket buffers of a client that reads
        # nothing; the next send then blocks.
        payload = json.dumps({"prompt": "é" * 1_500_000, "echo": True, "stream": True,
                              "max_tokens": 2000}, ensure_ascii=False).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
                         + payload)
            _wait_until(lambda: len(core.aborted) == 1, timeout=15)
            assert core.blocks_used == 0 and core.generation_tokens < 1500
        assert httpx.get(f"{srv.url}/health").status_code == 200


# ---- 6. body size, concurrency -----------------------------------------------------------

def _read_response(sock: socket.socket) -> tuple[int, dict]:
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length])


def test_a_declared_body_above_the_limit_is_413_before_it_is_read():
    with _serve(FakeCore(max_model_len=8192), max_request_body_size="4KiB") as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000000000\r\n\r\n")
            status, body = _read_response(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "--max-request-body-size" in body["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x" * 5000})
        assert_error(r, 413, code="request_too_large")
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x" * 3000,
                                                           "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_a_chunked_body_is_cut_off_at_the_limit_with_413():
    with _serve(FakeCore(), max_request_body_size="4KiB") as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 1000
            try:
                for _ in range(20):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass  # the server answered and closed while we were still sending
            status, body = _read_response(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"


def test_limit_concurrency_is_a_json_503_and_health_stays_answerable():
    """--limit-concurrency is the app's (server/overload.py), not uvicorn's plain-text one:
    work gets OpenAI's 503 at the limit, /health and /metrics are always answered."""
    assert uvicorn_config(object(), ServerSettings(limit_concurrency=2)).limit_concurrency \
        is None
    core = FakeCore()
    with _serve(core, limit_concurrency=1) as srv:
        core.pause()
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200
            busy = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
            assert_error(busy, 503, code="server_overloaded", contains="--limit-concurrency")
            assert busy.headers["retry-after"] == "1"
            assert httpx.get(f"{srv.url}/health").status_code == 200
            assert httpx.get(f"{srv.url}/metrics").status_code == 200
            core.resume()
            r.read()
        assert httpx.post(f"{srv.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 1}).status_code == 200


# ---- 7. /tokenize and /detokenize --------------------------------------------------------

class _BlockingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "SLOW" in text:
            self.entered.set()
            assert self.release.wait(30)
        return super().encode(text, add_special_tokens)


def test_tokenize_runs_off_the_event_loop():
    core = FakeCore()
    with _serve(core) as srv:
        tok = _BlockingTokenizer()
        srv.server.config.app.state.engine.tokenizer = tok
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            f"{srv.url}/tokenize", json={"prompt": "SLOW"}, timeout=60)))
        t.start()
        try:
            assert tok.entered.wait(10)
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        finally:
            tok.release.set()
            t.join(30)
        assert result["r"].json()["count"] == 4


def test_tokenize_and_detokenize_inputs_are_capped():
    with _serve(FakeCore()) as srv:
        assert_error(httpx.post(f"{srv.url}/tokenize", json={"prompt": "a" * 1_000_001},
                                timeout=30), 400, param="prompt", contains="at most 1000000")
        assert_error(httpx.post(f"{srv.url}/tokenize", json={"messages": [
            {"role": "user", "content": "a" * 600_000}] * 2}, timeout=30), 400,
            param="messages")
        assert_error(httpx.post(f"{srv.url}/detokenize", json={"tokens": [97] * 1_000_001},
                                timeout=30), 400, param="tokens")
        ok = httpx.post(f"{srv.url}/detokenize", json={"tokens": [104, 105]})
        assert ok.json() == {"prompt": "hi"}


# ---- 8. priority -------------------------------------------------------------------------

def test_priority_needs_the_priority_policy():
    with _serve(FakeCore()) as srv:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": CHAT})):
            assert_error(httpx.post(f"{srv.url}{path}", json={**body, "priority": -5}), 400,
                         param="priority", contains="--scheduling-policy priority")
            assert httpx.post(f"{srv.url}{path}", json={**body, "priority": 0,
                                                         "max_tokens": 1}).status_code == 200
    with _serve(FakeCore(scheduling_policy="priority")) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "priority": -5,
                                                          "max_tokens": 1})
        assert r.status_code == 200, r.text


# ---- 9. lone surrogates ------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud83d"]}, "stop.0"),
    ("/v1/completions", {"prompt": "x", "user": "\ud800"}, "user"),
    ("/v1/completions", {"prompt": "x", "\ud800": 1}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"x": "\udc00"}},
     "chat_template_kwargs.x"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogates_are_a_400(path, body, param):
    core = FakeCore()
    core.tokenizer = byte_tokenizer()  # a real tokenizer: it raises on surrogates
    with _serve(core) as srv:
        err = assert_error(_post_raw(srv.url, body, path), 400, contains="lone surrogate")
        assert err["param"] == param
        assert not core.requests and not core.aborted
        ok = _post_raw(srv.url, {"prompt": "fine \U0001F980", "max_tokens": 1})  # a real pair
        assert ok.status_code == 200, ok.text


# ---- 10. stream_options ------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_stream_options_without_stream_is_a_400(path, body):
    with _serve(FakeCore()) as srv:
        for stream in (False, None):
            extra = {} if stream is None else {"stream": stream}
            assert_error(httpx.post(f"{srv.url}{path}", json={
                **body, **extra, "stream_options": {"include_usage": True}}), 400,
                param="stream_options", contains="stream is true")


# ---- 12. a client gone before the first byte ---------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "SLOW", "max_tokens": 1000, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}],
                              "max_tokens": 1000, "stream": True}),
    ("/v1/completions", {"prompt": "SLOW", "max_tokens": 1000}),
])
def test_a_client_gone_before_the_response_starts_still_frees_its_request(path, body):
    core = FakeCore(max_model_len=2048, step_delay=0.02)  # 1000 tokens: 20 s unless aborted
    with _serve(core) as srv:
        engine = srv.server.config.app.state.engine
        tok = _BlockingTokenizer()
        engine.tokenizer = tok
        submitted: list[str] = []
        real_submit = engine.submit

        def submit(*args, **kwargs):
            stream = real_submit(*args, **kwargs)
            submitted.append(stream.request_id)
            return stream

        engine.submit = submit
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
            assert tok.entered.wait(10)  # the server is busy tokenising ...
        # ... when the client hangs up; the server notices before it submits the request.
        _wait_until(lambda: not srv.server.server_state.connections)
        tok.release.set()
        # Aborted, whether or not the engine thread had taken it in yet: nothing left anywhere.
        _wait_until(lambda: submitted and not engine._streams and not core.requests, timeout=10)
        assert core.blocks_used == 0 and core.generation_tokens < 1000


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1000, "stream": True}),
])
def test_a_stream_whose_first_send_fails_is_aborted(path, body):
    """ASGI 2.4 (the spec's current version): ``send`` raises OSError once the client is gone.
    When that happens on the very first message, the SSE body iterator never starts, so its
    own cleanup never runs: the response itself must abort the engine requests."""

    async def scenario() -> None:
        core = FakeCore(max_model_len=2048, step_delay=0.02)  # 1000 tokens: 20 s
        engine = AsyncEngine(core=core)
        app = build_app(engine)
        payload = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(payload)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        inbox = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive() -> dict:
            return inbox.pop(0) if inbox else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            raise OSError("the client is gone")

        try:
            await app(scope, receive, send)
            deadline = time.monotonic() + 10
            while engine._streams or core.requests or engine._inbox:
                assert time.monotonic() < deadline, "the engine request was never aborted"
                await asyncio.sleep(0.01)
            assert core.blocks_used == 0 and core.generation_tokens < 1000
        finally:
            engine.stop()

    asyncio.run(scenario())


# ---- 14. draining --------------------------------------------------------------------------

def test_health_is_503_while_draining_and_requests_in_flight_finish():
    core = FakeCore()
    engine = AsyncEngine(core=core)
    app = build_app(engine, ServerSettings(shutdown_timeout=10))
    timeouts: list[float] = []
    real_shutdown = engine.shutdown

    async def spy(timeout: float = 30.0) -> None:
        timeouts.append(timeout)
        await real_shutdown(timeout=timeout)

    engine.shutdown = spy
    with ServerThread(app) as srv:
        core.pause()
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200
            begin_drain(app)
            assert_error(httpx.get(f"{srv.url}/health"), 503, code="shutting_down")
            assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}), 503,
                         code="shutting_down")
            core.resume()
            events = parse_events(r.read().decode())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
        time.sleep(1.0)
    # The engine's final wait gets what is left of the one budget, not a fresh one.
    assert len(timeouts) == 1 and timeouts[0] <= 9.0


# ---- engine-side request errors ------------------------------------------------------------

def test_a_request_the_engine_could_not_finish_is_a_500_and_the_engine_goes_on():
    core = FakeCore()
    with _serve(core) as srv:
        err = assert_error(httpx.post(f"{srv.url}/v1/completions", json={
            "prompt": FAIL_PROMPT, "max_tokens": 5}), 500, code="internal_error")
        assert "secret" not in err["message"]
        assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": FAIL_PROMPT}]}), 500, code="internal_error")
        for path, body in (("/v1/completions", {"prompt": FAIL_PROMPT}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": FAIL_PROMPT}]})):
            with httpx.stream("POST", f"{srv.url}{path}", timeout=30, json={
                    **body, "max_tokens": 5, "stream": True}) as r:
                events = parse_events(r.read().decode())
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "internal_error"
            assert "secret" not in events[-2]["error"]["message"]
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.json()["choices"][0]["text"] == "ab"
        assert httpx.get(f"{srv.url}/health").status_code == 200


# ---- 15. exposed without a key ---------------------------------------------------------------

@pytest.mark.parametrize("host,key,warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True),
    ("my-host.example", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
    ("localhost", None, False), ("::1", None, False), ("127.0.0.2", None, False),
])
def test_exposure_warning(host, key, warns):
    msg = exposure_warning(ServerSettings(host=host, api_key=key))
    assert (msg is not None) == warns
    if warns:
        assert "--api-key" in msg and "KVSERVE_API_KEY" in msg and host in msg
