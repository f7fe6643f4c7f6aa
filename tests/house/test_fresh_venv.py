"""The README's install, from nothing: a copy of the checkout, a new virtual environment with no
system site-packages, only ``make install-test`` (what ``make test`` runs first), and then every
test module must import (pytest's collection). A dependency that only this machine happened to
have fails here. Slow (a minute or two: pip's cache and the kernels' build cache are reused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checkout_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.mark.slow
def test_the_readme_install_in_a_fresh_venv_imports_every_test_module(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    if os.environ.get("KVSERVE_CI_FRESH_VENV") == sys.prefix:
        pytest.skip(".ci/run made this very venv from nothing and ran `make install-test` in it: "
                    "this test's check, done once already")
    clone = tmp_path / "clone"
    for rel in _checkout_files():
        dst = clone / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    install = subprocess.run(["make", "install-test", f"PYTHON={py}"], cwd=clone, env=env,
                             capture_output=True, text=True, timeout=1500)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sys; print(sys.base_prefix != sys.prefix)"],
                          capture_output=True, text=True, env=env)
    assert site.stdout.strip() == "True"
    collect = subprocess.run([str(py), "-m", "pytest", "--collect-only", "-q", "tests"],
                             cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    assert " error" not in collect.stdout.splitlines()[-1]
