"""Issue 66, item 4: ``make run`` is cheap the second time.

Each install step leaves a stamp in the venv (``sys.prefix/.kvserve-make/<step>-<key>``, keys by
scripts/make_stamps.py); with the stamps there, ``make -n run`` plans no pip install and no
kernel check, only ``kvserve serve``. A changed pyproject.toml, or a venv without stamps (a
fresh one: CI's), plans the installs again. Run on a copy of the files the keys read, with
``$KVSERVE_MAKE_STAMPS`` pointing the stamps into the test's folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture
def checkout(tmp_path):
    clone = tmp_path / "clone"
    for rel in ("Makefile", "pyproject.toml", "scripts/make_stamps.py", "engine/cpu/build.py",
                "engine/cpu/kernels.py"):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, clone / rel)
    shutil.copytree(ROOT / "engine/cpu/csrc", clone / "engine/cpu/csrc")
    cache = tmp_path / "cache"
    (cache / "cpu-kernels" / "kvserve_cpu_kernels-0").mkdir(parents=True)
    (cache / "cpu-kernels" / "kvserve_cpu_kernels-0" / "kvserve-built").write_text("x.so")
    env = {**os.environ, "KVSERVE_MAKE_STAMPS": str(tmp_path / "prefix"),
           "KVSERVE_CACHE_DIR": str(cache)}
    return clone, env, tmp_path / "prefix" / ".kvserve-make"


def _plan(clone: Path, env: dict, target: str = "run") -> str:
    out = subprocess.run(["make", "-n", target, f"PYTHON={sys.executable}"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _keys(clone: Path, env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "scripts/make_stamps.py"], cwd=clone, env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_make_run_installs_once_then_only_serves(checkout):
    clone, env, stamps = checkout
    first = _plan(clone, env)
    assert "pip install" in first and "engine.cpu.kernels" in first  # no stamps: a fresh venv
    assert "kvserve serve" in first
    prefix, install, test, kernels = _keys(clone, env)
    assert prefix == str(stamps.parent) and "missing" not in (install, kernels)
    # What the recipes' `stamp` leaves after each step succeeded:
    stamps.mkdir(parents=True)
    (stamps / f"install-{install}").touch()
    (stamps / f"kernels-{kernels}").touch()
    os.utime(stamps / f"install-{install}", (1, 1))  # older than the kernels' stamp
    second = _plan(clone, env)
    assert "pip install" not in second and "engine.cpu.kernels" not in second, second
    assert "kvserve serve" in second and "install: up to date" in second
    # make test: the test extras once, then nothing either.
    assert 'pip install -q' in _plan(clone, env, "install-test")
    assert '-e ".[test,triton]"' in _plan(clone, env, "install-test")
    (stamps / f"install-test-{test}").touch()
    assert "pip install" not in _plan(clone, env, "install-test")

    # pyproject.toml changed: its key changes, the installs (and the kernel check) run again.
    with open(clone / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    third = _plan(clone, env)
    assert "pip install" in third and "engine.cpu.kernels" in third


def test_the_kernel_check_runs_again_when_the_cache_holds_no_build(checkout):
    clone, env, stamps = checkout
    prefix, install, _, kernels = _keys(clone, env)
    stamps.mkdir(parents=True)
    (stamps / f"install-{install}").touch()
    (stamps / f"kernels-{kernels}").touch()
    os.utime(stamps / f"install-{install}", (1, 1))
    assert "engine.cpu.kernels" not in _plan(clone, env)
    shutil.rmtree(Path(env["KVSERVE_CACHE_DIR"]) / "cpu-kernels")  # `kvserve cache` or rm -rf
    plan = _plan(clone, env)
    assert "engine.cpu.kernels" in plan and "pip install" not in plan


def test_a_stamp_is_never_written_under_a_missing_key(checkout, tmp_path):
    clone, env, stamps = checkout
    # The recipes' stamp command, as make runs it, with a key that says "not installed".
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\necho missing\n")
    script.chmod(0o755)
    out = subprocess.run(["make", "-n", "install", f"PYTHON={sys.executable}"], cwd=clone,
                         env=env, capture_output=True, text=True, check=True).stdout
    stamp_lines = [line for line in out.splitlines() if "make_stamps.py install)" in line]
    assert stamp_lines and '[ "$key" = missing ] ||' in stamp_lines[0]
    command = stamp_lines[0].replace(f"{sys.executable} scripts/make_stamps.py", str(script))
    subprocess.run(["sh", "-c", command], cwd=clone, check=True)
    assert not stamps.exists() or not any(stamps.iterdir())
