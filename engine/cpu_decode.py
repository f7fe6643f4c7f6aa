"""A small C++ (OpenMP) paged-decode kernel for the CPU path, built on first use.

Decode attention on a CPU is memory-bound: every step reads each sequence's whole K/V. The
PyTorch route gathers the blocks into a padded copy and then runs SDPA over it, touching the
data three times; this kernel reads K/V once, straight from the pool through the block table.
It is compiled with torch's cpp_extension (gcc + ninja) into torch's extension cache the first
time it is needed (~1 minute), and used for float32 pools. If it cannot be built, ``load()``
returns None, a warning says why, and the engine keeps the PyTorch route.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("kvserve.engine")
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_module = None
_failed = False


def load():
    """The compiled module (``paged_decode_cpu``), or None when it cannot be built or is
    disabled with ``KVSERVE_CPU_DECODE_KERNEL=0``."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("KVSERVE_CPU_DECODE_KERNEL", "1") == "0":
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load as load_ext

        logger.info("building the CPU paged-decode kernel (first use only)")
        _module = load_ext(name="kvserve_paged_decode_cpu", sources=[str(_SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        logger.warning("CPU paged-decode kernel unavailable (%s); using the PyTorch route",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        _failed = True
    return _module
