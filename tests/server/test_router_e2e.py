"""kvserve replicas (``python -m server.cli serve`` on a tiny random model) behind the real
routers, each started from its pip-installed wheel: sglang-router (``cache_aware``) and
vllm-router (``kv_aware``, which also subscribes to the replicas' KV events, decodes them
itself and places prompts by them: a prompt computed on one replica only, sent past the router,
is then routed to that replica).

Behind each router: no request the router made is answered 404 by kvserve (vllm-router renders
each prompt through vLLM's ``/v1/completions/render`` and, reading kvserve's answer, never
falls back to ``/tokenize``), the model is registered under its served name (the router's
``/v1/models``; sglang-router's log: its policy and tokenizer), completions go through, the
router's ``/get_loads`` reads every replica's load (sglang-router; vllm-router reads another
shape from the same path: -1), and the router's ``/flush_cache`` reaches every replica: a prompt
that was a prefix hit (``cached_tokens``) is a miss after it. With ``--api-key`` on the replica
and sglang-router, every probe and the flush carry the key (no 401 in the replica's log)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from loadgen.serve import free_port
from tests.server.helpers import start_server_process

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KEY = "router-e2e-key"
REQUEST_LINE = re.compile(r"kvserve\.server: ([A-Z]+) (\S+) (\d{3})[ :]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama",
                               max_position_embeddings=256)


def _replica(tiny, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"})
    return start_server_process(
        ["-m", "server.cli", "serve", str(tiny), "--served-model-name", "tiny",
         "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "256KiB",
         "--block-size", "4", "--kv-events-config", events, *extra], log, timeout=300)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def replicas(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    with ExitStack() as stack:
        out = []
        for i in range(2):
            proc, url = _replica(tiny, tmp / f"replica{i}.log")
            stack.callback(_stop, proc)
            out.append((url, tmp / f"replica{i}.log"))
        yield out


def _router(module: str, args: list[str], log: Path, headers=None, ready=None):
    """Start ``python -m MODULE ARGS`` and wait until its /v1/models answers (and ``ready``
    holds on the body); skips when the wheel is not installed or the binary cannot start."""
    pytest.importorskip(module.split(".")[0])
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1",
                                 "--port", str(port), "--prometheus-port", str(free_port()),
                                 *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.skip(f"{module} did not start here: {log.read_text()[-2000:]}")
        try:
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=5)
            if r.status_code == 200 and (ready is None or ready(r.json())):
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"{module} not ready: {log.read_text()[-3000:]}")
        time.sleep(0.5)


def _cached(url: str, prompt: str, headers=None) -> int:
    r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _answers(*logs: Path) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request the replicas logged."""
    out = []
    for log in logs:
        for m in REQUEST_LINE.finditer(log.read_text(errors="replace")):
            out.append((m.group(1), m.group(2).split("?")[0], int(m.group(3))))
    return out


def _flush_makes_a_hit_a_miss(url: str, prompt: str, headers=None) -> httpx.Response:
    _cached(url, prompt, headers)
    assert _cached(url, prompt, headers) > 0  # a prefix hit (the router sent it back)
    r = httpx.post(f"{url}/flush_cache", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert _cached(url, prompt, headers) == 0  # every replica dropped it
    return r


def test_sglang_router_cache_aware(replicas, tmp_path):
    log = tmp_path / "sglang-router.log"
    proc, url = _router("sglang_router.launch_router",
                        ["--worker-urls", *(u for u, _ in replicas), "--policy", "cache_aware"],
                        log, ready=lambda body: body.get("data"))
    try:
        # the model under its served name, not "unknown"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] \
            == ["tiny"]
        r = _flush_makes_a_hit_a_miss(url, "The quick brown fox jumps over the lazy dog " * 3)
        assert r.json()["status"] == "success" and r.json()["workers_flushed"] == 2
        loads = httpx.get(f"{url}/get_loads", timeout=30).json()["workers"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads)  # not -1
        for path in ("/get_server_info", "/get_model_info", "/health_generate"):
            assert httpx.get(url + path, timeout=60).status_code == 200, path
    finally:
        _stop(proc)
    text = log.read_text(errors="replace")
    assert "Assigning policy cache_aware to new model tiny" in text
    assert "Successfully registered tokenizer 'tiny'" in text
    assert "No tokenizer_path or model_path" not in text
    answers = _answers(*(lg for _, lg in replicas))
    probed = {path for _, path, _ in answers}
    assert {"/server_info", "/model_info", "/flush_cache", "/get_load"} <= probed
    assert [a for a in answers if a[2] == 404] == []


def test_vllm_router_kv_aware(replicas, tmp_path):
    log = tmp_path / "vllm-router.log"
    proc, url = _router("vllm_router.launch_router",
                        ["--worker-urls", *(u for u, _ in replicas), "--policy", "kv_aware"],
                        log)
    try:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] \
            == ["tiny"]
        r = _flush_makes_a_hit_a_miss(url, "Pack my box with five dozen liquor jugs " * 3)
        assert "flushed on all servers" in r.text
        # the policy routes by the replicas' events: prompts each computed on one replica
        # only (sent to it directly, past the router) are sent through the router to it
        workers = [u for u, _ in replicas]
        prompts = [f"{word} routes this: " + "how vexingly quick daft zebras jump " * 3
                   for word in ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot")]
        for i, prompt in enumerate(prompts):
            assert _cached(workers[i % 2], prompt) == 0
        time.sleep(1.0)  # the BlockStored events reach the router's subscribers
        assert all(_cached(url, p) > 0 for p in prompts)  # by chance: 1 in 64
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    finally:
        _stop(proc)
    text = log.read_text(errors="replace")
    for replica, _ in replicas:  # discovery read model, block size and KV-event sources
        assert f"kv_index {replica}: spawned subscriber rank0" in text
    assert "falling back to URL" not in text and "kv_event_sources parse" not in text
    assert "no block_size" not in text
    answers = _answers(*(lg for _, lg in replicas))
    probed = {path for _, path, _ in answers}
    assert {"/get_server_info", "/kv_event_sources", "/flush_cache",
            "/v1/completions/render"} <= probed
    assert "/tokenize" not in probed  # the router read the rendered token ids
    assert [a for a in answers if a[2] == 404] == []


def test_sglang_router_with_the_api_key(tiny, tmp_path):
    headers = {"Authorization": f"Bearer {KEY}"}
    replica, rurl = _replica(tiny, tmp_path / "replica.log", "--api-key", KEY)
    try:
        assert httpx.post(f"{rurl}/flush_cache", timeout=10).status_code == 401
        proc, url = _router("sglang_router.launch_router",
                            ["--worker-urls", rurl, "--policy", "cache_aware",
                             "--api-key", KEY], tmp_path / "router.log", headers=headers,
                            ready=lambda body: body.get("data"))
        try:
            assert httpx.get(f"{url}/v1/models", headers=headers,
                             timeout=10).json()["data"][0]["id"] == "tiny"
            _flush_makes_a_hit_a_miss(url, "Sphinx of black quartz, judge my vow " * 3,
                                      headers)
        finally:
            _stop(proc)
    finally:
        _stop(replica)
    answers = _answers(tmp_path / "replica.log")
    assert ("POST", "/flush_cache", 200) in answers
    assert [a for a in answers if a[2] in (401, 404)] == [("POST", "/flush_cache", 401)]
