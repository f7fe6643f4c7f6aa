"""Kernel-test setup: run Triton through its interpreter on CPU-only machines, and build
small paged KV layouts (shuffled, non-contiguous block tables) for the kernel tests.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here,
before any test module imports ``kernels``. With CUDA present the kernels run natively.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


def _require_interpreter() -> None:
    """Triton picks interpreted or GPU ``@jit`` objects once, when each is defined (its own
    ``tl.sum``, ``tl.cdiv`` ... included). If triton was imported before this file ran (other
    test folders first in one session), the kernels cannot run here: say how to fix it."""
    if "triton" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its "
                           "kernels cannot run on this CPU; set TRITON_INTERPRET=1 in the "
                           "environment or in tests/conftest.py when CUDA is absent")


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _require_interpreter()

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedCase:
    """A packed batch over a paged pool. ``query`` holds the last ``q_lens[b]`` tokens of each
    sequence; every key/value the batch can see is already in the pools."""

    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [NB, BS, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, maybe a strided view
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                      generator: torch.Generator, device=DEVICE) -> torch.Tensor:
    """Shuffled, gapped block ids (block 0 never used, so zero padding is never a real block),
    returned as a column slice of a wider table so that its row stride exceeds its width."""
    per_seq = [-(-s // block_size) for s in seq_lens]
    if sum(per_seq) > num_blocks - 1:
        raise ValueError("pool too small for the case")
    ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(per_seq)
    wide = torch.zeros(len(seq_lens), width + 3, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(per_seq):
        wide[b, :n] = torch.tensor(ids[taken:taken + n], dtype=torch.int32)
        taken += n
    return wide.to(device)[:, :width]


def make_paged_case(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                    seed: int = 0, strided_query: bool = False) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    used = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = used + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    tokens = sum(q_lens)
    if strided_query:  # a slice of a fused QKV projection, as the model hands it over
        fused = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
        query = fused.to(dtype).to(DEVICE)[:, :num_heads]
    else:
        query = torch.randn(tokens, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return PagedCase(
        query=query, k_cache=k_cache, v_cache=v_cache,
        block_tables=make_block_tables(seq_lens, block_size, num_blocks, g),
        cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )
