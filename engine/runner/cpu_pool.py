"""A CPU KV pool's memory: a zeroed anonymous mapping of its own that costs memory only where
requests write (:func:`zeroed_pool`), with the first blocks faulted in before serving
(:func:`fault_in_head`) so that the first request does not pay the page faults."""

from __future__ import annotations

import torch


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On a CPU it is an anonymous private mapping of its own: its pages are the
    kernel's shared zero page until written, so an idle pool holds no resident memory and a
    block costs memory once a request fills it, as llama.cpp's context does. (Not ``calloc``:
    whether glibc hands back fresh pages or memsets recycled heap depends on the process's
    allocation history; CI once saw a 128 MiB ``np.zeros`` become fully resident.)"""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    import numpy as np

    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel allows them (as numpy asks for its large arrays): the
        # attention kernels stride across the pool, and 4 KiB pages made decode slower
        # (docs/decisions.md#kv-pool-huge-pages).
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    # the array (and the tensor through it) keeps the mapping alive
    return torch.from_numpy(np.frombuffer(pages, dtype=np.uint8)).view(dtype).view(shape)


POOL_HEAD_BYTES = 64 * 1024  # the first blocks requests are handed (a few per layer)


def fault_in_head(pool: torch.Tensor) -> None:
    """Write the first :data:`POOL_HEAD_BYTES` of a CPU pool (zeros over zeros) before serving.
    The pool hands out its lowest blocks first, and the first writes into each fresh mapping
    (one per layer's K and V) made the first request after a start several times slower than
    the same request later (docs/decisions.md#kv-pool-first-writes); paid here instead, for
    memory the first request would have made resident anyway. The rest of the pool stays
    unbacked until requests write it."""
    if pool.device.type != "cpu" or pool.numel() == 0:
        return
    flat = pool.view(-1).view(torch.uint8)
    flat[:POOL_HEAD_BYTES].zero_()
