"""The CPU kernels' builder (engine/cpu/build.py): a build killed mid-compile (SIGKILL) must not
hang later starts (torch's cpp_extension waits for its ``lock`` baton without a time limit); a
live builder is waited for with a log line naming it, up to a bound; builds are named by what
they depend on. A tiny stub library (no torch headers) keeps the compiles to about a second."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.cpu import build as kbuild

ROOT = Path(__file__).resolve().parents[3]
STUB = 'extern "C" int kvserve_stub_answer() { return 42; }\n'


def _stub(tmp_path: Path, text: str = STUB) -> Path:
    src = tmp_path / "srcs" / "stub.cpp"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(text)
    return src


def _build_script(src: Path, root: Path) -> str:
    return textwrap.dedent(f"""
        import ctypes, sys
        from pathlib import Path
        from engine.cpu.build import build
        path = build("kvserve_stub", [Path({str(src)!r})], cflags=["-O0"],
                     is_python_module=False, root=Path({str(root)!r}), wait_s=60)
        print("ANSWER", ctypes.CDLL(path).kvserve_stub_answer())
    """)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("KVSERVE_KERNEL_BUILD_WAIT", None)
    return env


def test_a_build_killed_mid_compile_does_not_block_the_next_start(tmp_path):
    """The child stops inside the compiler (a CXX wrapper that sleeps), holding both our lock
    and torch's baton; SIGKILL to its whole process group; a fresh start then builds and loads
    within seconds instead of waiting on the dead build's baton forever."""
    src, root = _stub(tmp_path), tmp_path / "builds"
    marker = tmp_path / "compiling"
    slow_cxx = tmp_path / "slow-c++"
    slow_cxx.write_text(f"#!/bin/sh\ntouch {marker}\nsleep 300\nexec c++ \"$@\"\n")
    slow_cxx.chmod(0o755)
    # the CXX wrapper is part of the build's key: the restart must use the same folder
    child = subprocess.Popen([sys.executable, "-c", _build_script(src, root)],
                             env=_env(CXX=str(slow_cxx)), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the child build ended before compiling"
            assert time.monotonic() < deadline, "the child never reached the compiler"
            time.sleep(0.1)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    folders = [p for p in root.iterdir() if p.is_dir()]
    # the dead build's private folder, torch's baton inside: nothing published
    assert len(folders) == 1 and (folders[0] / "lock").exists() and ".tmp-" in folders[0].name
    normal_cxx = tmp_path / "c++"
    normal_cxx.write_text("#!/bin/sh\nexec c++ \"$@\"\n")
    normal_cxx.chmod(0o755)
    # same key as the killed build: rename the real compiler into the wrapper's path
    normal_cxx.replace(slow_cxx)
    out = subprocess.run([sys.executable, "-c", _build_script(src, root)],
                         env=_env(CXX=str(slow_cxx)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ANSWER 42" in out.stdout
    published = [p for p in root.iterdir() if p.is_dir()]
    assert len(published) == 1 and ".tmp-" not in published[0].name  # the leftover removed
    assert published[0].name == folders[0].name.split(".tmp-")[0].lstrip(".")


def test_a_live_builder_is_waited_for_with_its_pid_then_the_wait_gives_up(tmp_path, caplog):
    lock = tmp_path / "kvserve_stub-abc.lock"
    caplog.set_level(logging.INFO, logger="kvserve.engine")
    with kbuild.exclusive(lock):  # this process plays the live builder (a second open file)
        assert lock.read_text() == str(os.getpid())
        with pytest.raises(kbuild.BuildWaitTimeout) as err:
            with kbuild.exclusive(lock, wait_s=0.5, log_every_s=0.1):
                pass
    assert str(os.getpid()) in str(err.value) and str(tmp_path / "kvserve_stub-abc") in str(err.value)
    assert "waiting for another kvserve process building the kernels" in caplog.text
    with kbuild.exclusive(lock, wait_s=0.5):  # released with its holder's block
        pass


def test_builds_are_named_by_their_sources_and_flags_and_reused(tmp_path):
    src, root = _stub(tmp_path), tmp_path / "builds"
    first = kbuild.build("kvserve_stub", [src], cflags=["-O0"], is_python_module=False,
                         root=root)
    assert ctypes.CDLL(first).kvserve_stub_answer() == 42
    import torch.utils.cpp_extension as cpp

    def no_build(**kw):
        raise AssertionError("a published build must load without compiling")

    original, cpp.load = cpp.load, no_build
    try:
        again = kbuild.build("kvserve_stub", [src], cflags=["-O0"], is_python_module=False,
                             root=root)
    finally:
        cpp.load = original
    assert again == first and ctypes.CDLL(again).kvserve_stub_answer() == 42
    key = kbuild.build_key([src], ["-O0"], [])
    assert kbuild.build_key([src], ["-O1"], []) != key
    src.write_text(STUB.replace("42", "43"))
    assert kbuild.build_key([src], ["-O0"], []) != key


def test_another_instruction_set_is_built_under_its_own_name(monkeypatch):
    """KVSERVE_CPU_MARCH builds the kernels for that -march under a name of their own, so the
    native build is neither replaced nor reused for it."""
    from engine.cpu import kernels

    calls = []
    monkeypatch.setattr(kbuild, "build", lambda name, sources, **kw: calls.append(
        dict(kw, name=name)) or "module")
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failed", False)
    monkeypatch.setenv("KVSERVE_CPU_MARCH", "x86-64-v3")
    assert kernels.load() == "module"
    assert calls[0]["name"] == "kvserve_cpu_kernels_x86_64_v3"
    assert "-march=x86-64-v3" in calls[0]["cflags"]
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.delenv("KVSERVE_CPU_MARCH")
    kernels.load()
    assert calls[1]["name"] == "kvserve_cpu_kernels" and "-march=native" in calls[1]["cflags"]


def test_the_build_name_covers_torch_the_compiler_and_headers_not_the_checkout(tmp_path,
                                                                                 monkeypatch):
    """Issue 27 item 5: every checkout and version once built into one fixed folder
    (torch_extensions/py311_cpu/kvserve_cpu_kernels) and overwrote the others' builds."""
    import torch

    monkeypatch.setenv("CXX", "g++")
    src = _stub(tmp_path)
    header = src.parent / "stub.h"
    header.write_text("#define ANSWER 42\n")
    key = kbuild.build_key([src], ["-O0"], [], [src.parent])
    other_checkout = _stub(tmp_path / "elsewhere")  # same bytes, another path: shared
    (other_checkout.parent / "stub.h").write_text("#define ANSWER 42\n")
    assert kbuild.build_key([other_checkout], ["-O0"], [], [other_checkout.parent]) == key
    header.write_text("#define ANSWER 43\n")
    assert kbuild.build_key([src], ["-O0"], [], [src.parent]) != key
    header.write_text("#define ANSWER 42\n")
    assert kbuild.build_key([src], ["-O0"], ["-lm"], [src.parent]) != key
    monkeypatch.setenv("CXX", "clang++")
    assert kbuild.build_key([src], ["-O0"], [], [src.parent]) != key
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert kbuild.build_key([src], ["-O0"], [], [src.parent]) != key
    assert "torch_extensions" not in str(kbuild.build_root())
