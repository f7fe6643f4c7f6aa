"""The remote KV tier through two real servers (``python -m server.cli serve <tiny model>
--kv-remote-url ...``) sharing one real ``redis-server``: a prompt only replica A computed is
answered by replica B with ``usage.prompt_tokens_details.cached_tokens`` covering its prefix
and A's (cold) greedy text; /metrics counts the remote hits and the start-up log states the
tier. With ``redis-server`` killed, both replicas still answer every request, and /metrics says
the tier is down."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from tests.server.helpers import sample, scrape, start_server_process
from tests.support.kv_remote_redis import RedisServer

pytestmark = pytest.mark.slow
BS = 16


def _serve(tmp_path, model, url, name):
    return start_server_process(
        ["-m", "server.cli", "serve", str(model), "--served-model-name", "tiny",
         "--dtype", "float32", "--kv-cache-memory", "8MiB", "--block-size", str(BS),
         "--kv-remote-url", url], tmp_path / f"{name}.log", timeout=300)


def _complete(url: str, prompt: str) -> tuple[str, int, int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return (r.json()["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def test_replica_b_serves_what_replica_a_computed(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", "llama")
    prompt = "".join(f"row {i}: {i * 7 % 13} boxes; " for i in range(20))  # bytes: tokens
    with RedisServer(tmp_path / "redis") as redis_server:
        procs = []
        try:
            a, url_a = _serve(tmp_path, model, redis_server.url, "a")
            procs.append(a)
            b, url_b = _serve(tmp_path, model, redis_server.url, "b")
            procs.append(b)
            cold, prompt_tokens, cached = _complete(url_a, prompt)
            assert cached == 0 and prompt_tokens > 4 * BS
            written, deadline = 0.0, time.monotonic() + 60
            while time.monotonic() < deadline:  # A's writer thread: moments, more on busy cores
                written = sample(scrape(url_a), "kvserve:remote_kv_cache_written_blocks_total")
                if written >= (prompt_tokens - 1) // BS:
                    break
                time.sleep(0.1)
            assert written >= (prompt_tokens - 1) // BS
            text, _, cached = _complete(url_b, prompt)
            prefix = (prompt_tokens - 1) // BS * BS  # a hit never covers the last token
            assert cached >= 0.95 * prefix and text == cold
            metrics = scrape(url_b)
            assert sample(metrics, "kvserve:remote_kv_cache_blocks_total", result="hit") \
                == prefix // BS
            assert sample(metrics, "kvserve:remote_kv_cache_available") == 1

            # a reset of the remote tier empties the shared store: B's hit becomes a miss
            # for A (whose own device pool is dropped too)
            r = httpx.post(f"{url_b}/reset_prefix_cache?tier=remote", timeout=60)
            assert r.status_code == 200 and r.json()["dropped_blocks"]["remote"] >= prefix // BS
            httpx.post(f"{url_a}/reset_prefix_cache?tier=device", timeout=60).raise_for_status()
            assert _complete(url_a, prompt)[2] == 0

            redis_server.kill()  # both replicas serve on, without the tier
            for url in (url_a, url_b):
                for n in range(3):
                    text, _, _ = _complete(url, f"{n}: the store is gone. " * 12)
                    assert text
            for url in (url_a, url_b):
                assert sample(scrape(url), "kvserve:remote_kv_cache_available") == 0
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(120) in (0, -signal.SIGTERM)
    log = (tmp_path / "b.log").read_text()
    assert "remote KV tier: redis://127.0.0.1" in log
    warned = [line for line in log.splitlines() if "WARNING" in line and "kv remote tier" in line]
    assert len(warned) == 1, log
