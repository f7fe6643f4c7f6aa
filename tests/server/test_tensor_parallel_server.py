"""The real server (``kvserve serve`` in a subprocess, uvicorn on loopback) through a 2-rank
tensor-parallel engine: it answers; a worker killed while idle or in the middle of a stream, or
one that hangs (SIGSTOP), turns ``/health`` into 503 and the process exits non-zero within the
collective timeout (5 s here), never hangs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from loadgen.serve import free_port
from server.cli import ENGINE_DIED_EXIT_STATUS
from tests.server.helpers import start_server_process

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-server"), "llama")


@contextlib.contextmanager
def _started(tmp_path: Path, model: Path) -> Iterator[tuple[subprocess.Popen, str, Path, int]]:
    """The 2-rank server, its URL, log and rank 1's pid; both processes killed on the way out
    (whatever the test left running, e.g. a SIGSTOPped worker)."""
    log = tmp_path / "server.log"
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", str(model), "--tensor-parallel-size", "2",
         "--distributed-timeout", str(TIMEOUT_S), "--dtype", "float32",
         "--kv-cache-memory", "8MiB", "--num-threads", "1"], log, timeout=180)
    worker = int(re.search(r"spawned ranks \[1\] \(pids \[(\d+)\]", log.read_text()).group(1))
    try:
        yield proc, url, log, worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def _health_turns_503_and_process_exits(proc, url, log, since: float) -> None:
    codes = []
    while proc.poll() is None and time.monotonic() - since < TIMEOUT_S + 20:
        try:
            codes.append(httpx.get(f"{url}/health", timeout=1).status_code)
        except httpx.HTTPError:
            codes.append(None)  # the server is going away
        time.sleep(0.05)
    assert proc.wait(30) == ENGINE_DIED_EXIT_STATUS, log.read_text()
    assert time.monotonic() - since < TIMEOUT_S + 20
    assert 503 in codes or codes[-1:] == [None], codes
    assert "the engine died" in log.read_text()


def _complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_server_answers_then_a_killed_idle_worker_means_503_and_exit(tmp_path, tiny_dir):
    with _started(tmp_path, tiny_dir) as (proc, url, log, worker):
        body = _complete(url)
        assert body["usage"]["completion_tokens"] == 8
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        _health_turns_503_and_process_exits(proc, url, log, start)
        assert "WorkerDiedError" in log.read_text()


def test_worker_killed_during_a_stream_ends_the_stream_and_the_server(tmp_path, tiny_dir):
    with _started(tmp_path, tiny_dir) as (proc, url, log, worker):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.kill(worker, signal.SIGKILL)
            start = time.monotonic()
            try:
                rest = [line for line in lines if line]
            except httpx.HTTPError:
                rest = []
        assert not rest or rest[-1] != "data: [DONE]" or "error" in "".join(rest)
        _health_turns_503_and_process_exits(proc, url, log, start)


def test_a_hung_worker_times_out_instead_of_hanging_the_server(tmp_path, tiny_dir):
    with _started(tmp_path, tiny_dir) as (proc, url, log, worker):
        os.kill(worker, signal.SIGSTOP)
        start = time.monotonic()
        _health_turns_503_and_process_exits(proc, url, log, start)


def test_two_nodes_on_loopback_serve_and_node_one_exits_with_node_zero(tmp_path, tiny_dir):
    """The multi-host path on one machine: node 1 (no server) runs rank 1, node 0 serves;
    SIGTERM on node 0 stops node 1 cleanly (status 0)."""
    port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-method",
              f"tcp://127.0.0.1:{port}", "--dtype", "float32", "--kv-cache-memory", "8MiB",
              "--num-threads", "1", "--distributed-timeout", str(TIMEOUT_S)]
    log1 = tmp_path / "node1.log"
    with open(log1, "wb") as f:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", str(tiny_dir), "--node-rank", "1",
             *common], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    http = free_port()
    log0 = tmp_path / "node0.log"
    with open(log0, "wb") as f:
        node0 = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", str(tiny_dir), "--node-rank", "0",
             "--port", str(http), *common], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert node0.poll() is None and node1.poll() is None, (log0.read_text(),
                                                                    log1.read_text())
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log0.read_text()
            time.sleep(0.1)
        assert _complete(url)["usage"]["completion_tokens"] == 8
        assert "rank 1/2" in log1.read_text() and "rank 0/2" in log0.read_text()
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) in (0, -signal.SIGTERM)
        assert node1.wait(60) == 0, log1.read_text()
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
