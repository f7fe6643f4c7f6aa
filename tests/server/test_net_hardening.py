"""Hostile connections against a real ``kvserve serve`` (the embedded model) on loopback
(issue 27, items 1 and 4): an idle-connection flood above ``--limit-concurrency`` leaves
``/health`` answering and refuses work with OpenAI's 503; headers or a body that never finish
(slowloris) get a 408 and are closed; one address cannot hold more than
``--max-connections-per-client``; a client that stops reading is aborted after
``--stream-timeout`` and its KV blocks freed, though the kernel's buffers could take its
whole stream; SIGTERM mid-stream ends every stream with finish_reason "abort" and [DONE].
Every wait is bounded."""

from __future__ import annotations

import json
import signal
import socket
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.server.helpers import assert_error, sample, scrape, start_server_process
from tests.support.sse_events import parse_events

pytestmark = pytest.mark.slow  # a real model; ~1 minute

LIMIT, PER_CLIENT = 24, 40
HEADER_TIMEOUT, BODY_TIMEOUT, STREAM_TIMEOUT = 2, 3, 2


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    log = tmp_path_factory.mktemp("net") / "server.log"
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", "--max-model-len", "8192", "--kv-cache-memory", "256MiB",
         "--limit-concurrency", str(LIMIT), "--max-connections-per-client", str(PER_CLIENT),
         "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
         "--stream-timeout", str(STREAM_TIMEOUT), "--shutdown-timeout", "5"], log,
        timeout=600)
    try:
        yield url, log
    finally:
        proc.kill()
        proc.wait()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket, within: float) -> bytes:
    """Everything the server sends until it closes ``sock``; fails after ``within`` s."""
    sock.settimeout(within)
    data = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {within}s: {data[:200]!r}")


def _error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return int(head.split()[1]), err


def test_an_idle_connection_flood_leaves_health_answering(live):
    url, _ = live
    with ExitStack() as stack:
        idle = [stack.enter_context(socket.create_connection(("127.0.0.1", _port(url))))
                for _ in range(LIMIT + 8)]
        time.sleep(0.3)  # all accepted
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       timeout=30)
        assert_error(r, 503, code="server_overloaded", contains="--limit-concurrency")
        assert r.headers["retry-after"] == "1"
        for sock in idle:  # closed by the header timeout, without a response (sent nothing)
            assert _closed_by_server(sock, HEADER_TIMEOUT + 10) == b""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_slowloris_headers_and_bodies_get_408_and_are_closed(live):
    url, log = live
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(("127.0.0.1", _port(url))))
                 for _ in range(6)]
        for sock in socks[:3]:  # headers that never end
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for sock in socks[3:]:  # a body that never ends
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(1)
        for sock in socks:  # trickling more does not extend the deadline
            sock.sendall(b"a")
        for i, sock in enumerate(socks):
            status, err = _error_of(_closed_by_server(sock, BODY_TIMEOUT + 10))
            assert status == 408 and err["code"] == "request_timeout"
            assert ("--header-timeout" if i < 3 else "--body-timeout") in err["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert "Traceback" not in log.read_text()


def test_one_address_cannot_hold_more_than_its_share(live):
    url, _ = live
    with ExitStack() as stack:
        for _ in range(PER_CLIENT):
            stack.enter_context(socket.create_connection(("127.0.0.1", _port(url))))
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", _port(url))) as extra:
            status, err = _error_of(_closed_by_server(extra, 10))
        assert status == 503 and err["code"] == "too_many_connections"
        assert "--max-connections-per-client" in err["message"]


def test_a_client_that_never_reads_is_aborted_and_its_kv_freed(live):
    """The whole stream (8000 tokens, ~1.5 MB of events) fits in the kernel's buffers: the
    server's writes never block, so only the write side's progress can tell it stalled."""
    url, log = live
    before = scrape(url)
    body = json.dumps({"prompt": "Write a very long story.", "max_tokens": 8000,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", _port(url)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 60
        while True:  # it runs, holds blocks, and is aborted once its client stalls
            metrics = scrape(url)
            if "the client read nothing for 2s: stream aborted" in log.read_text() and \
                    sample(metrics, "kvserve:num_requests_running") == 0:
                break
            assert time.monotonic() < deadline, "the stalled stream is still generating"
            time.sleep(0.25)
        assert sample(metrics, "kvserve:kv_cache_used_blocks") == 0
        generated = sample(metrics, "kvserve:generation_tokens_total") - \
            sample(before, "kvserve:generation_tokens_total")
        assert 0 < generated < 8000
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_sigterm_mid_stream_ends_every_stream_with_abort_and_done(tmp_path):
    """Issue 27 item 3 on the real server: six long streams (chat and completions) and a
    non-streaming request are running when SIGTERM comes with --shutdown-timeout 3."""
    from concurrent.futures import ThreadPoolExecutor

    proc, url = start_server_process(
        ["-m", "server.cli", "serve", "--max-model-len", "4096", "--shutdown-timeout", "3"],
        tmp_path / "server.log", timeout=600)
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
    bodies = [("/v1/chat/completions", chat) if i % 2 else
              ("/v1/completions", {"prompt": "Once upon a time"}) for i in range(6)]
    try:
        with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120, json={
                "prompt": "Once", "max_tokens": 3000, "ignore_eos": True})
            streams = []
            for path, body in bodies:
                r = stack.enter_context(httpx.stream("POST", f"{url}{path}", timeout=120, json={
                    **body, "max_tokens": 3000, "ignore_eos": True, "stream": True}))
                lines = r.iter_lines()
                streams.append((lines, [next(x for x in lines if x.startswith("data:"))]))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert_error(httpx.get(f"{url}/health", timeout=10), 503, code="shutting_down")
            for lines, seen in streams:
                seen.extend(x for x in lines if x)  # raises on an incomplete chunked body
            assert_error(plain.result(), 503, code="shutting_down")
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for _, seen in streams:
        events = parse_events("\n\n".join(seen) + "\n\n")
        assert events[-1] == "[DONE]"
        assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                if c["finish_reason"]] == ["abort"]
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log
