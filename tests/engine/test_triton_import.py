"""A CPU engine that does not use the Triton backend never imports Triton (torch would, on its
first meta-device computation, and Triton's nanobind extension then prints "leaked instances"
at every exit: engine/triton_import.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loading.tiny import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from engine.llm import LLM
from engine.params.sampling import SamplingParams
llm = LLM(sys.argv[1], device="cpu", attention_backend=sys.argv[2])
out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))
print("generated", len(out[0].outputs[0].token_ids))
print("triton imported:", "triton" in sys.modules)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama")


def _run(model: Path, backend: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSERVE_CPU_KERNELS": "0",
           "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(model), backend], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_cpu_engine_on_the_torch_backend_never_imports_triton(tiny):
    proc = _run(tiny, "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 2" in proc.stdout
    assert "triton imported: False" in proc.stdout, proc.stdout
    assert "leaked" not in proc.stderr


def test_the_triton_backend_on_a_cpu_still_imports_and_uses_triton(tiny):
    pytest.importorskip("triton")
    proc = _run(tiny, "triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 2" in proc.stdout and "triton imported: True" in proc.stdout
