"""The CPU path's default KV pool budget, sized from the machine (llama.cpp sizes its context
from the model, vLLM's CPU backend from ``VLLM_CPU_KVCACHE_SPACE``): a share of the memory
available now, within a floor and a ceiling. ``--kv-cache-memory`` replaces it.

The pools are allocated lazily zeroed (``engine.runner.model_runner``): a block costs resident
memory only once a request has written it, so the budget bounds what the cache may grow to,
not what a start-up holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_GIB = 1024**3
CPU_KV_SHARE = 0.15
CPU_KV_FLOOR = 256 * 1024**2
CPU_KV_CEILING = 4 * _GIB


def available_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """``MemAvailable`` (what can be had without swapping), else free pages, else 8 GiB."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * _GIB


@dataclass(frozen=True)
class CPUKVBudget:
    """The default budget in bytes and what it was computed from."""

    budget: int
    available: int
    share: float = CPU_KV_SHARE
    floor: int = CPU_KV_FLOOR
    ceiling: int = CPU_KV_CEILING

    def describe(self) -> str:
        """One line for the start-up log: the figure and why."""
        raw = self.share * self.available
        bound = (" (the ceiling)" if raw > self.ceiling else
                 " (the floor)" if raw < self.floor else "")
        return (f"KV cache budget {self.budget / _GIB:.2f} GiB{bound} = {self.share:.0%} of "
                f"{self.available / _GIB:.1f} GiB available memory, within "
                f"[{self.floor / 2**20:.0f} MiB, {self.ceiling / _GIB:.0f} GiB]; blocks take "
                f"memory only once written; --kv-cache-memory sets it")


def cpu_kv_budget(available: int | None = None) -> CPUKVBudget:
    """``clamp(CPU_KV_SHARE * available, CPU_KV_FLOOR, CPU_KV_CEILING)`` bytes; ``available``
    defaults to :func:`available_ram_bytes`. Pure given ``available``."""
    avail = available_ram_bytes() if available is None else int(available)
    budget = int(min(max(CPU_KV_SHARE * avail, CPU_KV_FLOOR), CPU_KV_CEILING))
    return CPUKVBudget(budget=budget, available=avail)


def release_freed_memory() -> bool:
    """Hand the heap memory freed during loading back to the OS (glibc's ``malloc_trim``).

    Loading builds float copies, conversion buffers and probe inputs that are freed before
    serving, but glibc keeps freed heap pages mapped (the resident memory this gives back:
    docs/decisions.md#small-cpu-costs). True when it ran (glibc only)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
