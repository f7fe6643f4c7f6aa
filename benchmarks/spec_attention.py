"""Attention of a short query chunk over the paged cache on the CPU torch backend: the decode
group taken row by row (the compiled paged-decode kernel, what a speculative verification of
1 + k rows uses) against the prefill path (gather the blocks, masked SDPA), side by side.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), float32, block 16,
one sequence of ``ctx`` keys whose last ``q`` are new; min of 20 calls per layer.

    PYTHONPATH=. python benchmarks/spec_attention.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import engine.attention.torch_backend as tb
from engine.attention.metadata import AttentionMetadata

BS, H, KVH, D = 16, 9, 3, 64


def layer_us(q_len: int, ctx: int, small_rows: int) -> float:
    tb.SMALL_QUERY_ROWS = small_rows  # 0: every chunk takes the prefill path
    nb = -(-ctx // BS)
    kc, vc = torch.randn(nb, BS, KVH, D), torch.randn(nb, BS, KVH, D)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ctx - q_len, ctx), block_size=BS,
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=torch.arange(nb, dtype=torch.int32).unsqueeze(0), max_query_len=q_len,
        max_seq_len=ctx, num_decodes=0, num_decode_tokens=0, query_lens_cpu=[q_len],
        seq_lens_cpu=[ctx], all_slots_valid=True)
    q, k, v = torch.randn(q_len, H, D), torch.randn(q_len, KVH, D), torch.randn(q_len, KVH, D)
    backend = tb.TorchAttentionBackend()
    backend.prepare(meta)
    backend.forward(q, k, v, kc, vc, meta, D ** -0.5, None)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        backend.forward(q, k, v, kc, vc, meta, D ** -0.5, None)
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    small = tb.SMALL_QUERY_ROWS
    for ctx in (300, 2000, 8000):
        for q in (2, 4, 8, small):
            rows, sdpa = layer_us(q, ctx, small), layer_us(q, ctx, 0)
            print(f"ctx {ctx:5d}  q {q:2d}: row by row {rows:8.0f} us   prefill path "
                  f"{sdpa:8.0f} us   {sdpa / rows:4.2f}x")


if __name__ == "__main__":
    main()
