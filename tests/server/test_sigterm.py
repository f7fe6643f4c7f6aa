"""SIGTERM: the server stops accepting, lets the request in flight finish, then exits; with a
short timeout it aborts what is left instead of waiting. An engine that dies makes the process
exit non-zero, for a supervisor to restart it. The real serving path (run_server) runs in a
subprocess around a fake core that takes ``step_delay`` per token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cli import ENGINE_DIED_EXIT_STATUS
from tests.server.fake_server_main import DIE_PROMPT
from tests.server.helpers import ROOT, assert_error, start_server_process
from tests.support.sse_events import parse_events


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    log = tmp_path / "server.log"
    proc, url = start_server_process(["-m", "tests.server.fake_server_main", *args], log)
    return proc, url, log


@pytest.mark.parametrize("timeout,tokens,finishes", [("30", 60, True), ("0.5", 4000, False)])
def test_sigterm_drains_requests_in_flight_then_exits(tmp_path, timeout, tokens, finishes):
    proc, url, log = _start(tmp_path, "--step-delay", "0.01", "--shutdown-timeout", timeout)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": "x", "max_tokens": tokens, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            # New requests get 503 while the drain lasts; once it ends, connections are refused.
            with pytest.raises(httpx.HTTPError):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5)
                    time.sleep(0.05)
            try:
                rest = [line for line in lines if line]
            except httpx.HTTPError:
                rest = []  # the server closed the stream at the timeout
        # uvicorn re-raises the signal once it has shut down, as a process killed by it would
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = parse_events("\n\n".join([first, *rest]) + "\n\n")
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))
    if finishes:
        assert events[-1] == "[DONE]" and len(text) == tokens
    else:
        assert len(text) < tokens
    assert "draining requests in flight" in log.read_text()


def test_a_dead_engine_makes_the_process_exit_non_zero(tmp_path):
    # Listening on every interface without a key: the start-up log says so, loudly.
    proc, url, log = _start(tmp_path, "--host", "0.0.0.0")
    try:
        assert "NO API KEY" in log.read_text() and "WARNING" in log.read_text()
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            # a request that makes the step (the forward pass) fail: the engine loop dies
            assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": DIE_PROMPT},
                                    timeout=30), 503, code="engine_dead")
            events = parse_events("\n\n".join(line for line in lines if line) + "\n\n")
        assert events[-2]["error"]["code"] == "engine_dead" and events[-1] == "[DONE]"
        assert proc.wait(60) == ENGINE_DIED_EXIT_STATUS != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "the engine died (RuntimeError: simulated forward-pass failure)" in text
    assert "supervisor" in text


def test_a_taken_port_exits_non_zero_instead_of_hanging(tmp_path):
    """HTTP runs on a second thread (the engine on the main one): when uvicorn cannot bind, the
    engine loop is stopped too and the process exits with uvicorn's status, at once."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tests.server.fake_server_main",
                               "--port", str(port)], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr


def test_streams_still_running_at_the_budget_end_get_an_ending_and_done(tmp_path):
    """Issue 27 item 3: at the end of --shutdown-timeout, a stream gets a final chunk with
    finish_reason "abort" and [DONE] in a complete chunked body, a non-streaming request a 503;
    during the drain the socket still listens and /health answers the documented 503."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    proc, url, log = _start(tmp_path, "--step-delay", "0.02", "--shutdown-timeout", "2")
    bodies = [("/v1/completions", {"prompt": "x", "max_tokens": 4000, "n": 2}),
              ("/v1/completions", {"prompt": "y", "max_tokens": 4000}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 4000})]
    try:
        with ExitStack() as stack, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{url}/v1/completions", timeout=60,
                                json={"prompt": "z", "max_tokens": 4000})
            streams = []
            for path, body in bodies:
                r = stack.enter_context(httpx.stream("POST", f"{url}{path}", timeout=60,
                                                     json={**body, "stream": True}))
                lines = r.iter_lines()
                streams.append((lines, [next(x for x in lines if x.startswith("data:"))]))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert_error(httpx.get(f"{url}/health", timeout=5), 503, code="shutting_down")
            assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5),
                         503, code="shutting_down")
            for lines, seen in streams:
                seen.extend(x for x in lines if x)  # raises on an incomplete chunked body
            assert_error(plain.result(), 503, code="shutting_down")
        assert proc.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):  # the socket closed once the drain ended
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    for (_, seen), (_path, body) in zip(streams, bodies, strict=True):
        events = parse_events("\n\n".join(seen) + "\n\n")
        assert events[-1] == "[DONE]"
        ends = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert sorted(c["index"] for c in ends) == list(range(body.get("n", 1)))
        assert {c["finish_reason"] for c in ends} == {"abort"}
        assert len(events) > 3  # text was streamed before the cut
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text
    assert "request(s) still running end now" in text
