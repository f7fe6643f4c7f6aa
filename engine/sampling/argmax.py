"""The greedy token: per row, the index of the first maximal logit (``argmax``'s contract).

On a CPU with the C++ kernels built, one call: ``first_argmax_rows`` (engine/cpu/csrc/
argmax_cpu.cpp) scans each row once, in segments over the threads, and returns the same index,
ties and NaN included (it serves wherever built: docs/decisions.md#greedy-argmax).

Without the kernels (or for a non-contiguous or non-float32 input), a long row takes two
passes of PyTorch ops, since ``max(dim=-1)`` / ``argmax`` is one thread's serial loop while
``amax`` is vectorised and threaded: the maximum of every chunk (``amax``), then the first chunk
holding the row's maximum and the first maximal index inside it (the same index as ``argmax``,
ties and all). The chunk length divides the row where it can (:func:`chunk_length`), else a
ragged tail is taken on its own. Rows whose maximum is NaN, short rows (:func:`two_passes_pay`)
and other devices keep ``max(dim=-1)`` (NaN counts as the maximum there).
docs/decisions.md has the three paths' figures."""

from __future__ import annotations

from functools import lru_cache

import torch

CHUNK = 1024
# Where the two passes are used (measured on AVX-512 and AVX2 builds of PyTorch, two threads:
# docs/decisions.md#greedy-argmax): rows of at least MIN_WIDTH logits, and at least
# PER_THREAD logits for each thread of the single pass (which runs rows in parallel): below
# that the handful of extra small ops cost what the vectorised pass saves.
MIN_WIDTH = 16384
PER_THREAD = 65536


@lru_cache(maxsize=64)
def chunk_length(width: int) -> int:
    """The divisor of ``width`` nearest ``CHUNK`` within [CHUNK / 2, 2 CHUNK], else ``CHUNK``
    (and a ragged tail)."""
    best = CHUNK
    for c in range(CHUNK // 2, 2 * CHUNK + 1):
        if width % c == 0 and (width % best or abs(c - CHUNK) < abs(best - CHUNK)):
            best = c
    return best


@lru_cache(maxsize=1)
def _vectorised() -> bool:
    # PyTorch's own CPU kernels, as dispatched on this machine: without AVX2 (the DEFAULT
    # capability, or ATEN_CPU_CAPABILITY=default) amax is scalar too and two passes cost more
    # (docs/decisions.md#greedy-argmax).
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def two_passes_pay(rows: int, width: int, threads: int) -> bool:
    """Whether ``first_argmax`` takes the two passes for a ``[rows, width]`` CPU batch."""
    rows_per_thread = -(-rows // max(1, min(threads, rows)))
    return width >= MIN_WIDTH and rows_per_thread * width >= PER_THREAD and _vectorised()


@lru_cache(maxsize=1)
def _kernel():
    """The CPU kernels' ``first_argmax_rows``, or None where they are not built."""
    from engine.cpu.kernels import load

    k = load()
    return getattr(k, "first_argmax_rows", None) if k is not None else None


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D ``x`` (int64, one index per row)."""
    rows, width = x.shape
    if x.device.type == "cpu" and x.dtype == torch.float32 and width > 0 and x.is_contiguous():
        kernel = _kernel()
        if kernel is not None:
            return kernel(x)
    if x.device.type != "cpu" or not two_passes_pay(rows, width, torch.get_num_threads()):
        return x.max(dim=-1).indices
    return two_passes(x)


def two_passes(x: torch.Tensor) -> torch.Tensor:
    """``first_argmax`` of a CPU ``x`` in two passes of PyTorch ops (module docstring)."""
    rows, width = x.shape
    c = chunk_length(width)
    body = width - width % c
    chunks = x[:, :body].reshape(rows, body // c, c)
    chunk_max = chunks.amax(dim=-1)
    row_max = chunk_max.amax(dim=-1)
    tail = x[:, body:]
    if body < width:
        row_max = torch.maximum(row_max, tail.amax(dim=-1))
    if bool(row_max.isnan().any()):
        return x.max(dim=-1).indices
    holds = chunk_max == row_max.unsqueeze(1)
    first = holds.to(torch.uint8).argmax(dim=-1)  # the first chunk holding the maximum
    picked = chunks[torch.arange(rows), first]
    index = first * c + picked.max(dim=-1).indices
    if body < width:  # a row whose maximum is only in the tail
        index = torch.where(holds.any(dim=-1), index, body + tail.max(dim=-1).indices)
    return index
