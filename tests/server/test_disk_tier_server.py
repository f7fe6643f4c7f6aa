"""The disk KV tier through a real server (the embedded model): after SIGTERM and a start on
the same --kv-disk-dir, a prompt seen before reports >= 90 % of its tokens as cached, greedy
output is identical to a device prefix-cache hit's, /metrics counts the disk hits and the
start-up log states the tier. A --kv-disk-dir that cannot be used does not stop the server: it
serves without the tier."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.server.helpers import sample, scrape, start_server_process

pytestmark = pytest.mark.slow


def _serve(tmp_path, disk, n):
    return start_server_process(
        ["-m", "server.cli", "serve", "--max-model-len", "2048", "--kv-cache-memory", "64MiB",
         "--kv-disk-dir", str(disk), "--kv-disk-size", "256MiB"],
        tmp_path / f"server{n}.log", timeout=600)


def _complete(url: str, prompt: str) -> tuple[str, int, int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return (r.json()["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def test_restart_serves_the_prefix_from_disk(tmp_path):
    disk = tmp_path / "kv"
    prompt = " ".join(f"Item {i}: the {i % 7}th colour of the {i % 11}th box." for i in range(60))
    texts = []
    for n in range(2):
        proc, url = _serve(tmp_path, disk, n)
        try:
            text, prompt_tokens, cached = _complete(url, prompt)
            texts.append(text)
            if n == 0:
                assert cached == 0
                # the same prompt again: served from the device prefix cache, the output the
                # restored blocks must give (a hit of any tier computes only the last tokens)
                text, _, cached = _complete(url, prompt)
                texts[0] = text
                assert cached >= 0.9 * prompt_tokens
            else:
                assert cached >= 0.9 * prompt_tokens
                metrics = httpx.get(f"{url}/metrics", timeout=30).text
                assert "kvserve:prefix_cache_disk_hits_total" in metrics
                hits = [line for line in metrics.splitlines()
                        if line.startswith("kvserve:prefix_cache_disk_hits_total")]
                assert float(hits[0].rsplit(" ", 1)[1]) >= cached
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) in (0, -signal.SIGTERM)
    assert texts[0] == texts[1]
    log = (tmp_path / "server1.log").read_text()
    assert "disk KV tier:" in log and "blocks found" in log


def test_an_unusable_disk_dir_serves_without_the_tier(tmp_path):
    """``--kv-disk-dir`` under a regular file (cannot be created, by root either): the server
    starts and answers (it used to exit with status 2: a crash loop under a supervisor), logs
    one WARNING naming the directory, and /metrics says the tier is down."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    disk = blocker / "kv"
    proc, url = _serve(tmp_path, disk, "unusable")
    try:
        text, prompt_tokens, _ = _complete(url, "The disk tier is optional: " * 20)
        assert text and prompt_tokens > 0
        metrics = scrape(url)
        assert sample(metrics, "kvserve:disk_kv_cache_available") == 0
        assert sample(metrics, "kvserve:disk_kv_cache_full") == 0
        assert sample(metrics, "kvserve:disk_kv_cache_write_errors_total") >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) in (0, -signal.SIGTERM)
    log = (tmp_path / "serverunusable.log").read_text()
    warned = [line for line in log.splitlines() if "WARNING" in line and str(disk) in line]
    assert len(warned) == 1, log
