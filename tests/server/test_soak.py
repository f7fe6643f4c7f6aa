"""Soak: a real ``kvserve serve`` (tiny random model, a small KV pool that forces preemption)
under a few hundred mixed requests from 16 clients at once — good ones (plain and streamed),
bad ones, abandoned streams and slow readers. Every good request completes with exactly the
tokens it asked for, every bad one gets a 4xx in OpenAI's shape, and afterwards the server is
healthy and holds no KV block."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from server.bench.serve import free_port
from tests.server.helpers import sample, scrape

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
         "--port", str(port)],
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
        yield url
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


def test_mixed_traffic_completes_and_leaks_nothing(server):
    with ThreadPoolExecutor(16) as pool:
        kinds = list(pool.map(lambda i: _one(server, i), range(NUM_REQUESTS)))
    assert len(kinds) == NUM_REQUESTS and {"good", "bad", "abandon", "slow"} <= set(kinds)
    deadline = time.monotonic() + 60
    while True:
        metrics = scrape(server)
        used = sample(metrics, "kvserve:kv_cache_used_blocks")
        running = sample(metrics, "kvserve:num_requests_running")
        if used == 0 and running == 0:
            break
        assert time.monotonic() < deadline, f"{used} blocks still in use, {running} running"
        time.sleep(0.2)
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert sample(metrics, "kvserve:num_preemptions_total") > 0  # the pool was under pressure
