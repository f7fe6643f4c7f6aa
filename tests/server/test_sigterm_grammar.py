"""SIGTERM while a constraint is being compiled (issue 64 item 4): the process used to wait in
the interpreter's exit for the grammar worker (224 s quiet, over 21 minutes loaded). Now a real
``kvserve serve`` (tiny random model) exits within ``--shutdown-timeout`` plus a few seconds
however long that compile would have run, and leaves no grammar process behind. The constraint
is a 38-byte schema whose pattern takes xgrammar over a minute to expand."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from tests.server.helpers import start_server_process

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT = 2.0
SLOW = {"type": "string", "pattern": "a{40000}"}


def _children(pid: int) -> set[int]:
    import os

    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def test_sigterm_during_a_compile_exits_within_the_budget(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", "llama", seed=1)
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", str(model), "--max-model-len", "256",
         "--kv-cache-memory", "16MiB", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
        tmp_path / "server.log", timeout=300)
    try:
        answers: list[int] = []

        def hostile() -> None:
            try:
                answers.append(httpx.post(f"{url}/v1/completions", timeout=300, json={
                    "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": SLOW}}
                ).status_code)
            except httpx.HTTPError:
                answers.append(-1)

        t = threading.Thread(target=hostile, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while not _children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # the vetting process has started on it
        vet = _children(proc.pid)
        time.sleep(3.0)  # the compile is under way
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        took = time.monotonic() - t0
        assert took < SHUTDOWN_TIMEOUT + 12, f"exit took {took:.1f}s"
        assert proc.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
        time.sleep(0.5)
        assert not any(_children(1) & vet) and all(not _alive(p) for p in vet)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
