"""The kernel build's precompiled header (engine/cpu/pch.py): built with exactly the flags
torch's cpp_extension compiles the sources with (else GCC silently ignores it and every source
parses the header again), used by a source that includes it first, and never published."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from engine import envs
from engine.cpu import kernels, pch
from engine.cpu.build import build_root

CSRC = Path(kernels.__file__).parent / "csrc"


def _published_ninja() -> Path:
    if kernels.load() is None:
        pytest.skip("the CPU kernels are not built here")
    names = sorted(build_root().glob(f"{kernels._NAME}-*/build.ninja"),
                   key=lambda p: p.stat().st_mtime)
    for ninja in reversed(names):
        if "-march=native" in ninja.read_text():
            return ninja
    pytest.skip("no native kernel build with its build.ninja here")


def _site(flags: list[str]) -> list[str]:
    """Paths inside a venv named from its site-packages (venvs with the same torch share one
    build, so the build found may be another venv's)."""
    return [re.sub(r"^.*/site-packages/", "<site-packages>/", f) for f in flags]


def test_the_header_is_precompiled_with_cpp_extensions_own_flags():
    ninja = _published_ninja()
    line = next(x for x in ninja.read_text().splitlines() if x.startswith("cflags = "))
    theirs = shlex.split(line.removeprefix("cflags = "))
    src = next(Path(f[2:]) for f in theirs if f.startswith("-I"))
    ours = pch.flags(kernels._NAME, src, ["-O3", "-march=native", "-fopenmp"])
    assert _site(ours) == _site(theirs)
    assert not list(ninja.parent.glob("src/*.gch"))  # removed before publishing


def test_a_source_that_includes_it_first_reads_the_precompiled_header(tmp_path):
    for name in ("torch_lite.h",):
        (tmp_path / name).write_bytes((CSRC / name).read_bytes())
    (tmp_path / "one.cpp").write_text('#include "torch_lite.h"\n'
                                      "at::Tensor twice(const at::Tensor& x) { return x; }\n")
    cflags = ["-O0"]
    assert pch.precompile("kvserve_pch_test", tmp_path, "torch_lite.h", cflags)
    cmd = [envs.cxx(), *pch.flags("kvserve_pch_test", tmp_path, cflags), "-H", "-Winvalid-pch",
           "-fsyntax-only", str(tmp_path / "one.cpp")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # -H marks a precompiled header it used with "!" and lists no header it parsed from it
    assert f"! {tmp_path / 'torch_lite.h.gch'}" in out.stderr, out.stderr[:2000]
    assert "invalid" not in out.stderr
    pch.remove(tmp_path, "torch_lite.h")
    assert not (tmp_path / "torch_lite.h.gch").exists()


def test_a_header_that_does_not_compile_leaves_no_file_and_the_build_goes_on(tmp_path):
    (tmp_path / "broken.h").write_text("this is not C++\n")
    assert not pch.precompile("kvserve_pch_test", tmp_path, "broken.h", ["-O0"])
    assert not (tmp_path / "broken.h.gch").exists()
