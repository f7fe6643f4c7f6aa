"""Issue 66, item 2: a start says what it does and when it is ready.

``kvserve serve`` logs the start-up phases with their times, then exactly one line
``kvserve ready: http://HOST:PORT (model NAME, N KV blocks = T tokens, max concurrency C)``
once uvicorn listens; no ``model None -> ...`` line, no transformers ``torch_dtype``
deprecation warning, and a CPU server never imports Triton.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.loading.tiny import make_tiny_model_dir
from tests.server.helpers import ROOT

READY = re.compile(r"kvserve ready: http://127\.0\.0\.1:(\d+) \(model (\S+), (\d+) KV blocks = "
                   r"(\d+) tokens, max concurrency ([\d.]+)\)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("first-hour") / "tiny-llama")


def _env(tmp: Path) -> dict[str, str]:
    # No CPU kernels: a private cache would compile them (minutes); the phases are the point.
    return {**os.environ, "PYTHONPATH": str(ROOT), "KVSERVE_CACHE_DIR": str(tmp / "cache"),
            "KVSERVE_CPU_KERNELS": "0"}


def test_serve_logs_phases_then_one_ready_line_once_it_accepts_connections(tiny, tmp_path):
    with socket.socket() as s:  # a free port, given explicitly: the line must name it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", str(tiny), "--port", str(port),
             "--max-model-len", "256", "--served-model-name", "tiny"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not READY.search(log.read_text()):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        # Logged after uvicorn listens: a connection is accepted at once, and served.
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    ready = READY.findall(text)
    assert len(ready) == 1, text
    got_port, name, blocks, tokens, _ = ready[0]
    assert int(got_port) == port and name == "tiny"
    assert int(tokens) % int(blocks) == 0 and int(tokens) >= int(blocks)
    lines = text.splitlines()
    ready_at = next(i for i, line in enumerate(lines) if "kvserve ready:" in line)
    startup_at = next(i for i, line in enumerate(lines) if "Application startup complete" in line)
    assert startup_at < ready_at
    assert re.search(r"start-up: model loaded in [\d.]+ s \(.*load [\d.]+ s\)", text), text
    assert "model tiny-llama: a Hugging Face directory" in text
    assert "model None" not in text and "torch_dtype" not in text, text
    assert "nanobind" not in text and "leaked" not in text, text


BUILD_APP = """
import sys
from server.cli import _settings, build_parser
from server.app import build_app
from engine.async_engine import AsyncEngine
args = build_parser().parse_args(["serve", sys.argv[1], "--max-model-len", "128"])
engine_config, settings = _settings(args)
engine = AsyncEngine(engine_config)
app = build_app(engine, settings)
from fastapi.testclient import TestClient
with TestClient(app) as client:
    r = client.post("/v1/completions", json={"model": engine.core.model_name, "prompt": "hi",
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={
        "model": engine.core.model_name, "prompt": "hi", "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}})
    assert r.status_code == 200, r.text
engine.stop()
print("triton imported:", "triton" in sys.modules)
"""


def test_a_cpu_server_never_imports_triton(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-c", BUILD_APP, str(tiny)], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton imported: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "torch_dtype" not in proc.stderr


CONVERT = """
import sys
from pathlib import Path
from engine.loading.loader import resolve_model
files = resolve_model(sys.argv[1], cache_dir=Path(sys.argv[2]), progress=False)
print("converted", files.path.is_dir())
print("triton imported:", "triton" in sys.modules)
"""


def test_converting_a_gguf_on_a_cpu_host_never_imports_triton(tmp_path):
    from tests.support.tiny_models import _make_llama_gguf

    gguf = tmp_path / "tiny.gguf"
    _make_llama_gguf(gguf, tied=True, quantised=True)
    proc = subprocess.run([sys.executable, "-c", CONVERT, str(gguf), str(tmp_path / "cache")],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converted True" in proc.stdout
    assert "triton imported: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
