"""The real server for the end-to-end tests (tests/server/, tests/loadgen/): ``python -m server.cli
serve`` in a subprocess with the embedded model, started once per session (the ``real_server``
fixture of tests/conftest.py) from a config file plus overriding flags (which test_e2e_openai.py
checks round-trips into the running server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from loadgen.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2e-key"
# In the file: a context the flags override, a small KV pool so start-up stays quick.
CONFIG_FILE = """\
served-model-name: smol-e2e
max-model-len: 4096
kv-cache-memory: 48MiB
max-num-seqs: 8
max-num-batched-tokens: 512
enable-prefix-caching: true
shutdown-timeout: 10
"""
FLAGS = ["--max-model-len", "1024", "--api-key", API_KEY, "--seed", "0"]
KV_CACHE_BYTES = 48 * 2**20


@dataclass
class RealServer:
    url: str
    log_path: Path
    proc: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0,
                             timeout=300)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def run_real_server(tmp_path_factory) -> Iterator[RealServer]:
    """The ``real_server`` fixture's body (tests/conftest.py): start, wait for health, yield,
    stop."""
    tmp = tmp_path_factory.mktemp("kvserve-e2e")
    cfg = tmp / "server.yaml"
    cfg.write_text(CONFIG_FILE)
    port = free_port()
    log_path = tmp / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--config", str(cfg), "--port",
             str(port), *FLAGS], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = RealServer(f"http://127.0.0.1:{port}", log_path, proc)
    try:  # the server stops whatever happens, a failed start included
        deadline = time.monotonic() + 600  # model load on a busy 2-core machine
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become healthy:\n{server.log()[-4000:]}")
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
