"""OpenMP's idle spinning is bounded before torch loads (engine/cpu/omp_spin.py): set where the
user left it alone, never over the user's own setting, and by ``kvserve``'s entry point before
anything imports torch, so that torch's libgomp reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.cpu import omp_spin

ROOT = Path(__file__).resolve().parents[3]


def test_bounds_only_what_the_user_left_alone(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as before torch's import (restored after)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_spin.bound_spinning() == str(omp_spin.SPIN_COUNT)
    assert os.environ["GOMP_SPINCOUNT"] == "3000"
    assert "spin 3000 times" in omp_spin.describe()
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert omp_spin.bound_spinning() is None and os.environ["GOMP_SPINCOUNT"] == "0"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert omp_spin.bound_spinning() is None and "GOMP_SPINCOUNT" not in os.environ
    assert "ACTIVE" in omp_spin.describe()


def test_too_late_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded: libgomp has read its environment

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_spin.bound_spinning() is None and "GOMP_SPINCOUNT" not in os.environ


def test_the_entry_point_bounds_it_before_torch_loads(tmp_path):
    script = ("import os, sys\n"
              "from server import cli\n"
              "assert 'torch' not in sys.modules\n"
              "cli.main(['cache', 'ls'])\n"
              "print('SPIN', os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(PYTHONPATH=str(ROOT), KVSERVE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"SPIN {omp_spin.SPIN_COUNT}" in out.stdout
