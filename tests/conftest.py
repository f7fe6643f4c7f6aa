"""Shared pytest setup: make the repo importable and keep torch to the cores we have."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton kernels run under the interpreter on machines without a GPU. The variable only takes
# effect if set before triton is first imported, so it is set here, before any test module.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _project_logs_reach_caplog(monkeypatch):
    """A test that starts the CLI in-process runs ``configure_logging``, which stops our loggers
    propagating to the root (where ``caplog`` listens); later tests must still see records."""
    for name in ("kvserve", "engine", "server", "kvserve_kernels"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    """``kvserve serve`` on the embedded model in a subprocess, once per session, for the
    end-to-end tests of tests/server/ and tests/loadgen/ (tests/support/real_server.py)."""
    from tests.support.real_server import run_real_server

    yield from run_real_server(tmp_path_factory)


@pytest.fixture
def default_quant_settings(monkeypatch):
    """Call it to leave the quantised modules' settings at their defaults instead of measured:
    float32 panels above the decode kernels' rows, the base decode kernels, no int8 tiles. Where
    a test compares two engines, or teacher-forces whole sequences through the dense path, a
    timing must not choose its numerics (on these tiny shapes int8 tiles can win the prefill
    probe, and on a random model their int8-rounded activations flip ~14% of near-tied top-1
    tokens; on the trained model they are held to 1% of perplexity:
    tests/engine/test_smollm2.py)."""
    def apply() -> None:
        from engine.quantization import probe as quant_probe
        from engine.weight_prep import apply as quant_apply

        defaults = lambda q, rows=(): {}  # noqa: E731
        monkeypatch.setattr(quant_probe, "measure_settings", defaults)
        monkeypatch.setattr(quant_apply, "measure_settings", defaults)

    return apply
