"""A build lock left by a process killed while compiling the CPU kernels must not hang every
later start (torch's cpp_extension waits for it without a time limit)."""

from __future__ import annotations

import os
import time

from engine.cpu.kernels import STALE_LOCK_SECONDS, clear_stale_lock


def test_an_old_lock_is_removed(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) is True
    assert not lock.exists()
    assert "stale CPU-kernel build lock" in caplog.text


def test_a_fresh_lock_is_left_to_the_build_that_holds_it(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert clear_stale_lock(tmp_path) is False
    assert lock.exists()


def test_no_lock_is_nothing_to_do(tmp_path):
    assert clear_stale_lock(tmp_path) is False


def test_another_instruction_set_is_built_under_its_own_name(monkeypatch):
    """KVSERVE_CPU_MARCH builds the kernels for that -march under a name of their own, so the
    native build in torch's extension cache is neither replaced nor reused for it."""
    import torch.utils.cpp_extension as cpp

    from engine.cpu import kernels

    calls = []
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or "module")
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failed", False)
    monkeypatch.setenv("KVSERVE_CPU_MARCH", "x86-64-v3")
    assert kernels.load() == "module"
    assert calls[0]["name"] == "kvserve_cpu_kernels_x86_64_v3"
    assert "-march=x86-64-v3" in calls[0]["extra_cflags"]
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.delenv("KVSERVE_CPU_MARCH")
    kernels.load()
    assert calls[1]["name"] == "kvserve_cpu_kernels" and "-march=native" in calls[1]["extra_cflags"]
