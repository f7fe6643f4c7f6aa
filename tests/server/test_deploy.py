"""Deployment files: the container entrypoint's dispatch, compose + Prometheus wiring, the
Dockerfile's contract, and (where the Debian ``prometheus`` package is installed) promtool on our
/metrics output and a real Prometheus scraping a server."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from engine.async_engine import AsyncEngine
from server.app import build_app
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_kvserve(tmp_path):
    """A ``kvserve`` on PATH that prints its arguments, to see what the entrypoint runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "kvserve"
    exe.write_text('#!/bin/sh\necho "kvserve $*"\n')
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KVSERVE_PORT": "8000",
            "KVSERVE_HOST": "0.0.0.0"}


@pytest.mark.parametrize("args,expected", [
    ([], "kvserve serve --host 0.0.0.0 --port 8000"),
    (["/models/llama", "--max-model-len", "8192"],
     "kvserve serve --host 0.0.0.0 --port 8000 /models/llama --max-model-len 8192"),
    (["--config", "c.yaml"], "kvserve serve --host 0.0.0.0 --port 8000 --config c.yaml"),
    (["serve", "--port", "9000"], "kvserve serve --host 0.0.0.0 --port 8000 --port 9000"),
    (["SmolLM2-135M-Instruct"], "kvserve serve --host 0.0.0.0 --port 8000 SmolLM2-135M-Instruct"),
    (["kv-calc", "--help"], "kvserve kv-calc --help"),
    (["generate", "--prompt", "hi"], "kvserve generate --prompt hi"),
    (["echo", "plain"], "plain"),
])
def test_entrypoint_dispatch(fake_kvserve, args, expected):
    out = subprocess.run(["sh", str(ROOT / "docker" / "entrypoint.sh"), *args],
                         env=fake_kvserve, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_compose_wires_prometheus_to_the_server():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"kvserve", "prometheus"} <= set(services)
    assert "8000:8000" in services["kvserve"]["ports"]
    assert any(v.endswith(":/models:ro") for v in services["kvserve"]["volumes"])
    prom = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert targets == ["kvserve:8000"]
    assert prom["scrape_configs"][0].get("metrics_path", "/metrics") == "/metrics"


def test_dockerfile_contract():
    text = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 8000" in text and "/health" in text and "HEALTHCHECK" in text
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]' in text
    assert "docker/entrypoint.sh" in text and "cuda" in text.lower()


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="Debian's prometheus package is not installed")


@needs_promtool
def test_promtool_accepts_the_prometheus_config():
    subprocess.run(["promtool", "check", "config", str(ROOT / "docker" / "prometheus.yml")],
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def busy_fake_server():
    with ServerThread(build_app(AsyncEngine(core=FakeCore()))) as srv:
        for stream in (False, True):
            httpx.post(f"{srv.url}/v1/completions", timeout=30,
                       json={"prompt": "x", "max_tokens": 3, "stream": stream}).raise_for_status()
        yield srv


@needs_promtool
def test_promtool_lints_our_metrics(busy_fake_server):
    text = httpx.get(f"{busy_fake_server.url}/metrics").text
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         text=True)
    # vLLM's "name:metric" convention (kept for dashboards) is the only thing it may flag.
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if line.strip() and "should not contain ':'" not in line]
    assert problems == []


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary")
def test_prometheus_scrapes_the_server(busy_fake_server, tmp_path):
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "kvserve", "static_configs": [
            {"targets": [busy_fake_server.url.removeprefix("http://")]}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        result: list = []
        while not result:
            assert time.monotonic() < deadline, "Prometheus never stored our samples"
            time.sleep(0.5)
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5, params={
                    "query": 'kvserve:request_success_total{finished_reason="length"}'})
                result = r.json()["data"]["result"] if r.status_code == 200 else []
            except httpx.HTTPError:
                continue
        assert float(result[0]["value"][1]) == 2
        assert result[0]["metric"]["model_name"] == "fake-model"
    finally:
        proc.terminate()
        proc.wait(30)
