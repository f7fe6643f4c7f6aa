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
