"""KV memory of the hybrid KV cache vs one block table for every layer (issue 28's targets).

A Gemma-3-270M-shaped KV cache: 18 layers, 1 KV head of 256, bfloat16, sliding window 512 on
five layers of every six (``layer_types`` of the checkpoint), block size 16. Both sides run the
scheduler's own KV managers step by step, as the engine drives them (prefill in chunks of
``--chunk`` tokens, then decode; ``commit`` and ``release_outside_window`` after every step):

- baseline: ``KVCacheManager``, one table for all layers (a page = 18 layers' K/V of 16 tokens);
  a model with a full layer releases nothing;
- hybrid: ``HybridKVCacheManager`` over ``plan_kv_groups`` (6 groups of 3 layers; a page = 3
  layers' K/V of 16 tokens), pool sized from the same ``--kv-cache-memory`` the way
  ``ModelRunner.allocate_kv_cache`` does.

Prints (1) the KV bytes one ``--tokens``-token sequence holds at its end, and (2) how many such
sequences are alive at once when they are admitted one after another until the pool is full
(each prefilled and decoded to its length), with the ratios. No forward pass is run: what is
measured is block accounting, which is what decides memory and admission in the engine.

    python benchmarks/hybrid_kv.py [--tokens 8192] [--kv-cache-memory 1GiB]
"""

from __future__ import annotations

import argparse

from engine.kv_cache.groups import plan_kv_groups
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.kv_cache.manager import KVCacheManager

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, WINDOW, BS = 18, 1, 256, 2, 512, 16
WINDOWS = tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(LAYERS))
LAYER_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V of one layer


def _parse_bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
    for unit, mult in units.items():
        if text.lower().endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    return int(text)


def _managers(budget: int):
    layout = plan_kv_groups(WINDOWS)
    flat_page = LAYERS * LAYER_BYTES_PER_TOKEN * BS
    hyb_page = layout.group_size * LAYER_BYTES_PER_TOKEN * BS
    flat = KVCacheManager(budget // flat_page, BS, enable_prefix_caching=True)
    hyb = HybridKVCacheManager(budget // hyb_page, BS, layout, enable_prefix_caching=True)
    return (flat, flat_page, None), (hyb, hyb_page, layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--decode", type=int, default=64,
                    help="of --tokens, how many are decoded one per step after the prefill")
    args = ap.parse_args()
    budget = _parse_bytes(args.kv_cache_memory)
    n, prompt_len = args.tokens, args.tokens - args.decode
    results = {}
    for kv, page, layout in _managers(budget):
        name = "hybrid" if layout is not None else "baseline"
        # One sequence: the prompt in chunks, then decode steps.
        tokens = [i % 32000 for i in range(n)]
        ok = _grow_seq(kv, "one", tokens, prompt_len, args.chunk)
        assert ok, "the pool cannot hold one sequence: raise --kv-cache-memory"
        held = kv.num_live_blocks("one") * page
        kv.free("one")
        kv.reset_prefix_cache()
        # Concurrency: distinct sequences (no prefix sharing) until the pool is full.
        alive = 0
        while _grow_seq(kv, f"s{alive}", [(alive * 7919 + i) % 32000 for i in range(n)],
                        prompt_len, args.chunk):
            alive += 1
        kv.check_integrity()
        results[name] = (held, alive, kv.num_blocks, page)
        groups = (f"{layout.num_groups} groups of {layout.group_size} layers, windows "
                  f"{layout.windows}" if layout else f"1 group of {LAYERS} layers")
        print(f"{name:8s}: {groups}; pool {kv.num_blocks} blocks x {page} B; one {n}-token "
              f"sequence holds {held / 2**20:.2f} MiB; {alive} such sequences at once")
    (h0, a0, _, _), (h1, a1, _, _) = results["baseline"], results["hybrid"]
    print(f"KV bytes of one {n}-token sequence, hybrid / baseline: {h1 / h0:.3f}x "
          f"(target <= 0.3x)")
    print(f"concurrent {n}-token sequences at --kv-cache-memory {args.kv_cache_memory}: "
          f"{a1} vs {a0} = {a1 / max(1, a0):.2f}x (target >= 3x)")


def _grow_seq(kv, seq_id: str, tokens: list[int], prompt_len: int, chunk: int) -> bool:
    """Prefill ``tokens[:prompt_len]`` in chunks, then decode the rest one a step (commit and
    window release after each step, as the scheduler does). False if the pool ran short (the
    sequence is freed)."""
    hybrid = isinstance(kv, HybridKVCacheManager)
    done = 0
    while done < len(tokens):
        step = min(chunk, prompt_len - done) if done < prompt_len else 1
        if kv.allocate(seq_id, done + step) is None:
            kv.free(seq_id)
            return False
        done += step
        kv.commit(seq_id, tokens, done)
        if hybrid:
            kv.release_outside_window(seq_id, done)
    return True


if __name__ == "__main__":
    main()
