"""KV-cache kernels: Triton on NVIDIA GPUs, with ``kvserve_kernels.reference`` as the PyTorch truth.

``copy_blocks`` works without Triton (index copies); the attention kernels and ``store_kv``
need the ``triton`` package (``pip install 'kvserve[triton]'``). On a CPU they only run under
``TRITON_INTERPRET=1``, which must be set before this package is imported.
"""

from __future__ import annotations

import importlib.util

from kvserve_kernels.copy_blocks import copy_blocks

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    from kvserve_kernels.paged_attention import paged_attention
    from kvserve_kernels.paged_decode import choose_num_splits, paged_decode_attention
    from kvserve_kernels.store_kv import store_kv
else:  # pragma: no cover - exercised only without triton

    def _needs_triton(*_args, **_kwargs):
        raise ImportError("this kernel needs the triton package (pip install 'kvserve[triton]')")

    store_kv = paged_attention = paged_decode_attention = choose_num_splits = _needs_triton

__all__ = ["HAS_TRITON", "choose_num_splits", "copy_blocks", "paged_attention",
           "paged_decode_attention", "store_kv"]
