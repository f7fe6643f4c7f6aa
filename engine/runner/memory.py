"""GPU memory budget for the KV pool: pure arithmetic on one snapshot of the device's figures.

Contract (vLLM's meaning of ``gpu_memory_utilization``): ``utilization`` is the share of the
*whole device* this instance may occupy. Against it count everything on the device that is not
PyTorch's own cache (``non_torch = (total - free) - torch_reserved``: other processes, this
process's CUDA context, NCCL/cuBLAS handles), kvserve's own peak (``torch_peak``, the
``max_memory_allocated`` of the largest step the scheduler may issue, profiled after a reset),
and a ``reserve`` for fragmentation and later workspaces (default ``max(256 MiB, 2% of total)``):

  ``budget = utilization * total - non_torch - torch_peak - reserve``
It is never more than can be had now, ``free + torch_reserved - torch_peak - reserve``:
substituting ``non_torch`` gives that less ``(1 - utilization) * total``, and where the figures
do not add up (a snapshot racing another process) ``non_torch`` is clamped to 0. Tests check the
bound. ``kv_cache_budget`` raises ``ValueError`` naming the figures in GiB and the settings to
change when the budget is not positive. ``MemorySnapshot.capture`` alone touches CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GIB = 1024**3
_MIN_RESERVE = 256 * 1024**2
_RESERVE_SHARE = 0.02


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory figures in bytes, taken at one moment after the profiling step.

    ``total``/``free``: ``torch.cuda.mem_get_info`` (whole device, every process, CUDA context
    included); ``torch_reserved``: held by PyTorch's caching allocator; ``torch_allocated``:
    handed out by it now (weights, and anything else still alive); ``torch_peak``: the most it
    handed out since the peak statistics were reset before profiling."""

    total: int
    free: int
    torch_reserved: int
    torch_allocated: int
    torch_peak: int

    def __post_init__(self) -> None:
        if self.total <= 0 or not 0 <= self.free <= self.total:
            raise ValueError(f"implausible device memory: total={self.total}, free={self.free}")
        if min(self.torch_reserved, self.torch_allocated, self.torch_peak) < 0:
            raise ValueError("PyTorch memory figures must be >= 0")

    @classmethod
    def capture(cls, device: torch.device | str | int) -> MemorySnapshot:
        """Read the figures of CUDA ``device`` now. Call after the profiling step has been
        synchronized and its temporaries freed; ``empty_cache`` before or not does not change
        the budget (free + reserved is what counts)."""
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=int(total), free=int(free),
                   torch_reserved=int(torch.cuda.memory_reserved(device)),
                   torch_allocated=int(torch.cuda.memory_allocated(device)),
                   torch_peak=int(torch.cuda.max_memory_allocated(device)))


@dataclass(frozen=True)
class KVBudget:
    """The KV pool budget in bytes and the pieces it was computed from (all bytes)."""

    budget: int
    total: int
    utilization: float
    utilization_cap: int  # utilization * total
    non_torch: int  # other processes + CUDA context + non-PyTorch allocations
    model_peak: int  # weights + the profiled step's activations (torch_peak)
    activation_headroom: int  # torch_peak - torch_allocated: freed now, needed again per step
    reserve: int

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"KV cache budget {_gib(self.budget)} = {self.utilization:.2f} x "
                f"{_gib(self.total)} device - {_gib(self.non_torch)} other processes/CUDA "
                f"context - {_gib(self.model_peak)} model peak (weights + "
                f"{_gib(self.activation_headroom)} activations) - {_gib(self.reserve)} reserve")


def default_reserve(total: int) -> int:
    """``max(256 MiB, 2% of total)``."""
    return max(_MIN_RESERVE, int(total * _RESERVE_SHARE))


def kv_cache_budget(snap: MemorySnapshot, utilization: float,
                    reserve: int | None = None) -> KVBudget:
    """Bytes the KV pool may take on the device of ``snap`` (see the module docstring).

    Raises ``ValueError`` when ``utilization`` is outside (0, 1], ``reserve`` is negative, or no
    positive budget is left; the message names the figures and what to change."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {utilization}")
    reserve = default_reserve(snap.total) if reserve is None else int(reserve)
    if reserve < 0:
        raise ValueError(f"the memory reserve must be >= 0 bytes; got {reserve}")
    peak = max(snap.torch_peak, snap.torch_allocated)
    non_torch = max(0, snap.total - snap.free - snap.torch_reserved)
    cap = int(snap.total * utilization)
    out = KVBudget(budget=cap - non_torch - peak - reserve, total=snap.total,
                   utilization=utilization, utilization_cap=cap, non_torch=non_torch,
                   model_peak=peak, activation_headroom=peak - snap.torch_allocated,
                   reserve=reserve)
    if out.budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {utilization:.2f} "
            f"allows {_gib(cap)} of the {_gib(snap.total)} device; other processes and the CUDA "
            f"context use {_gib(non_torch)}, the model's peak (weights + activations of the "
            f"largest step) is {_gib(peak)} and {_gib(reserve)} is kept in reserve. Raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-model-len (a "
            f"smaller activation peak), free the GPU of other processes, or set "
            f"--kv-cache-memory explicitly.")
    return out
