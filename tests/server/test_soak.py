"""Soak: a real ``kvserve serve`` (tiny random model, a small KV pool that forces preemption)
under a few hundred mixed requests from 16 clients at once — good ones (plain and streamed),
bad ones, abandoned streams and slow readers — while hostile connections come and go: an idle
flood, slowloris headers and bodies, clients that never read their stream. Every good request
completes with exactly the tokens it asked for, every bad one gets a 4xx in OpenAI's shape, the
hostile connections are closed by the server's timeouts, and afterwards the server is healthy
and holds no KV block. Last, SIGTERM mid-stream: every stream still running ends with
``finish_reason: "abort"`` and ``[DONE]``."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from loadgen.serve import free_port
from tests.server.helpers import sample, scrape
from tests.support.sse_events import parse_events

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 300
BAD_BODIES = [
    {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": "hot"},
    {"prompt": [10**9]}, {"prompt": "x", "n": 0}, {"prompt": "x", "logprobs": 99},
    {"prompt": "x", "stop": ["a"] * 1000}, {"prompt": "x", "model": "nope"},
    {"prompt": "x" * 500, "max_tokens": 64}, {}, {"prompt": "x", "stream_options": {}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    path = make_tiny_model_dir(tmp / "tiny", "llama", max_position_embeddings=128)
    port = free_port()
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", str(path), "--served-model-name", "tiny",
         "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64KiB",
         "--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--header-timeout", "2", "--body-timeout", "2", "--stream-timeout", "2",
         "--shutdown-timeout", "1", "--port", str(port)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:  # the server stops whatever happens, a missed start deadline included
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
        yield url, proc, tmp / "server.log"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def _one(url: str, i: int) -> str:
    rng = random.Random(i)
    kind = rng.choice(["good", "good", "stream", "bad", "abandon", "slow"])
    prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40)))
    want = rng.randint(1, 12)
    body = {"prompt": prompt, "max_tokens": want, "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True, "seed": i}
    with httpx.Client(base_url=url, timeout=300) as c:
        if kind == "bad":
            r = c.post("/v1/completions", json=rng.choice(BAD_BODIES))
            assert 400 <= r.status_code < 500, r.text
            assert r.json()["error"]["message"]
            return kind
        if kind == "good":
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == want
            return kind
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            chunks, last = 0, ""
            for line in r.iter_lines():
                last = line or last
                if line.startswith("data: {"):
                    chunks += 1
                    if kind == "abandon":
                        return kind  # closes the connection mid-stream
                    if kind == "slow":
                        time.sleep(0.05)
            assert last == "data: [DONE]" and chunks >= 1
    return kind


def _hostile(url: str, stop: threading.Event) -> dict[str, int]:
    """Until ``stop``: waves of idle connections, slowloris headers and bodies, and clients
    that send a streaming request and never read. Counts the connections the server closed."""
    port = int(url.rsplit(":", 1)[1])
    starts = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
              b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"]
    never_read = json.dumps({"prompt": "abc", "max_tokens": 100, "ignore_eos": True,
                             "stream": True}).encode()
    counts = {"opened": 0, "closed_by_server": 0}
    while not stop.is_set():
        with ExitStack() as stack:
            socks = []
            for i in range(30):
                sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                if i % 10 == 9:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n"
                                 % len(never_read) + never_read)
                else:
                    sock.sendall(starts[i % 3])
                socks.append((i % 10 == 9, sock))
            counts["opened"] += len(socks)
            for reads_nothing, sock in socks:
                if reads_nothing:
                    continue  # its request finishes (or is aborted) without it reading
                sock.settimeout(10)
                try:
                    while sock.recv(65536):
                        pass
                    counts["closed_by_server"] += 1
                except (ConnectionResetError, TimeoutError):
                    pass
    return counts


def test_mixed_traffic_completes_and_leaks_nothing(server):
    url = server[0]
    stop = threading.Event()
    with ThreadPoolExecutor(1) as hostile_pool:
        hostile = hostile_pool.submit(_hostile, url, stop)
        try:
            with ThreadPoolExecutor(16) as pool:
                kinds = list(pool.map(lambda i: _one(url, i), range(NUM_REQUESTS)))
        finally:
            stop.set()
        counts = hostile.result(timeout=120)
    assert len(kinds) == NUM_REQUESTS and {"good", "bad", "abandon", "slow"} <= set(kinds)
    # Every hostile connection that was not a never-reading stream was closed by the server.
    assert counts["opened"] >= 30 and counts["closed_by_server"] == counts["opened"] * 9 // 10
    deadline = time.monotonic() + 60
    while True:
        metrics = scrape(url)
        used = sample(metrics, "kvserve:kv_cache_used_blocks")
        running = sample(metrics, "kvserve:num_requests_running")
        if used == 0 and running == 0:
            break
        assert time.monotonic() < deadline, f"{used} blocks still in use, {running} running"
        time.sleep(0.2)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert sample(metrics, "kvserve:num_preemptions_total") > 0  # the pool was under pressure


def test_sigterm_mid_stream_ends_every_stream(server):
    """Runs last: the server exits. --shutdown-timeout 1 is too short for these streams."""
    url, proc, log = server
    body = {"prompt": "abc", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with ExitStack() as stack:
        streams = []
        for _ in range(6):
            r = stack.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                 timeout=60))
            lines = r.iter_lines()
            streams.append((lines, [next(x for x in lines if x.startswith("data:"))]))
        proc.send_signal(signal.SIGTERM)
        for lines, seen in streams:
            seen.extend(x for x in lines if x)  # raises on an incomplete chunked body
    assert proc.wait(60) in (0, -signal.SIGTERM)
    for _, seen in streams:
        events = parse_events("\n\n".join(seen) + "\n\n")
        assert events[-1] == "[DONE]"
        ends = [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                if c["finish_reason"]]
        assert ends in (["abort"], ["length"])  # cut at the budget's end, or done by then
    assert "Traceback" not in log.read_text()
