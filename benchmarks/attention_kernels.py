"""Decode-attention kernel timings on an NVIDIA GPU: Triton paged decode vs PyTorch SDPA.

For each (batch, context) the script times, with CUDA events after warm-up and with the L2
cache flushed before every timed call:

* ``paged``: ``kernels.paged_decode_attention`` over a paged pool with shuffled block tables;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V laid out
  contiguously (``[B, KVH, ctx, D]``, grouped-query heads via ``enable_gqa``);

and reports the achieved bandwidth (K/V bytes read / time) next to the device's copy
bandwidth, measured here as (bytes read + bytes written) / time of a large device-to-device
copy, i.e. the memory traffic rate a streaming kernel can reach. It also checks that both
outputs agree. Targets on H100/H200: for batch >= 32 and context >= 4k, paged >= 70% of copy
bandwidth and no slower than 1.2x SDPA.

    python benchmarks/attention_kernels.py                 # full grid, a few minutes
    python benchmarks/attention_kernels.py --batches 1,64 --contexts 4096 --json results.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# ``kernels`` package; put the repository root there instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    batch: int
    context: int
    num_splits: int | None
    kv_gib: float
    paged_us: float | None = None
    paged_gbps: float | None = None
    paged_pct_of_copy: float | None = None
    sdpa_us: float | None = None
    sdpa_gbps: float | None = None
    paged_over_sdpa: float | None = None  # time ratio: < 1 means the paged kernel is faster
    max_abs_diff: float | None = None
    target_met: bool | None = None  # only for batch >= 32 and context >= 4096
    skipped: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers: {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
        return values

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=ints, default=[512, 1024, 4096, 8192, 16384, 32768])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-splits", type=int, default=None,
                   help="fix the split count (default: the kernel's heuristic)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-kv-gib", type=float, default=16.0,
                   help="skip (batch, context) pairs whose K/V exceed this (per layout)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.num_heads % args.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    if args.block_size & (args.block_size - 1):
        p.error("--block-size must be a power of two")
    return args


class Timer:
    """Mean time of a CUDA callable over ``iters`` calls, each after an optional L2 flush."""

    def __init__(self, warmup: int, iters: int, flush: bool):
        self.warmup, self.iters = warmup, iters
        # Larger than any current L2 (H100/H200: 50 MiB), so each call reads K/V from HBM.
        self.flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush \
            else None

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        total_ms = 0.0
        for _ in range(self.iters):
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            total_ms += start.elapsed_time(end)
        return total_ms / self.iters * 1e3  # microseconds


def copy_bandwidth_gbps(timer: Timer, gib: float = 2.0) -> float:
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6) / 1e9  # read + write


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """``q`` ``[B, H, 1, D]``, ``k``/``v`` ``[B, KVH, ctx, D]`` contiguous (or already
    expanded to ``H`` heads on torch < 2.5, which lacks ``enable_gqa``)."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def _sdpa_has_gqa() -> bool:
    q = torch.zeros(1, 2, 1, 16, device="cuda")
    k = torch.zeros(1, 1, 4, 16, device="cuda")
    try:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    except TypeError:
        return False
    return True


def run(args: argparse.Namespace) -> list[Row]:
    from tqdm import tqdm

    from kvserve_kernels.paged_decode import choose_num_splits, paged_decode_attention

    dtype = DTYPES[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    h, kvh, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    token_bytes = 2 * kvh * d * esize  # K and V of one token, one layer
    scale = 1.0 / math.sqrt(d)
    timer = Timer(args.warmup, args.iters, not args.no_flush)

    combos = [(b, c) for b in args.batches for c in args.contexts]
    fits = [(b, c) for b, c in combos if b * c * token_bytes / 2**30 <= args.max_kv_gib]
    num_blocks = max((b * -(-c // bs) for b, c in fits), default=0) + 1  # block 0 stays unused
    # One pool for the whole run, filled once; each combination uses a random set of blocks.
    k_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device="cuda") if fits else None
    v_cache = torch.randn_like(k_cache) if fits else None

    copy_gbps = copy_bandwidth_gbps(timer)
    has_gqa = _sdpa_has_gqa()
    rows: list[Row] = []
    for b, c in tqdm(combos, desc="decode attention", unit="case"):
        kv_gib = b * c * token_bytes / 2**30
        if (b, c) not in fits:
            rows.append(Row(b, c, None, kv_gib, skipped=f"K/V over --max-kv-gib "
                                                         f"{args.max_kv_gib:g}"))
            continue
        per_seq = -(-c // bs)
        tables = torch.randperm(num_blocks - 1, device="cuda")[: b * per_seq] + 1
        tables = tables.view(b, per_seq).to(torch.int32)
        seq_lens = torch.full((b,), c, dtype=torch.int32, device="cuda")
        query = torch.randn(b, h, d, dtype=dtype, device="cuda")
        splits = args.num_splits or choose_num_splits(b, kvh, c, query.device, head_dim=d,
                                                      dtype=dtype)
        out = torch.empty_like(query)

        def paged(query=query, tables=tables, seq_lens=seq_lens, out=out, splits=splits, c=c):
            paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, scale, splits,
                                   max_seq_len=c, out=out)

        # The same K/V, contiguous, as a dense-attention engine would hold them.
        k = k_cache[tables.long()].view(b, per_seq * bs, kvh, d)[:, :c].transpose(1, 2)
        v = v_cache[tables.long()].view(b, per_seq * bs, kvh, d)[:, :c].transpose(1, 2)
        k, v = k.contiguous(), v.contiguous()
        if not has_gqa:  # old torch: SDPA then reads H/KVH times the bytes; shown as such
            k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        q4 = query.unsqueeze(2)

        paged()
        ref_out = sdpa_decode(q4, k, v, scale).squeeze(2)
        diff = (out.float() - ref_out.float()).abs().max().item()
        paged_us = timer(paged)
        sdpa_us = timer(lambda q4=q4, k=k, v=v: sdpa_decode(q4, k, v, scale))
        nbytes = b * c * token_bytes
        row = Row(b, c, splits, kv_gib, paged_us=paged_us, sdpa_us=sdpa_us,
                  paged_gbps=nbytes / (paged_us * 1e-6) / 1e9,
                  sdpa_gbps=nbytes / (sdpa_us * 1e-6) / 1e9,
                  paged_over_sdpa=paged_us / sdpa_us, max_abs_diff=diff)
        row.paged_pct_of_copy = 100 * row.paged_gbps / copy_gbps
        if b >= 32 and c >= 4096:
            row.target_met = row.paged_pct_of_copy >= 70 and row.paged_over_sdpa <= 1.2
        rows.append(row)
        del k, v
    print_table(rows, copy_gbps, args, torch.cuda.get_device_name())
    if args.json:
        payload = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                   "config": {k: v for k, v in vars(args).items() if k != "json"},
                   "rows": [asdict(r) for r in rows]}
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return rows


def print_table(rows: list[Row], copy_gbps: float, args: argparse.Namespace,
                device_name: str) -> None:
    print(f"\n{device_name}  copy bandwidth {copy_gbps:,.0f} GB/s (read+write)"
          f"  | H={args.num_heads} KVH={args.num_kv_heads} D={args.head_dim} "
          f"block={args.block_size} {args.dtype}")
    head = (f"{'batch':>5} {'ctx':>6} {'splits':>6} {'KV GiB':>7} {'paged us':>9} {'GB/s':>7} "
            f"{'%copy':>6} {'sdpa us':>9} {'GB/s':>7} {'paged/sdpa':>10} {'maxdiff':>8} target")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.skipped:
            print(f"{r.batch:>5} {r.context:>6} {'':>6} {r.kv_gib:>7.2f}  skipped: {r.skipped}")
            continue
        target = {None: "", True: "ok", False: "MISSED"}[r.target_met]
        print(f"{r.batch:>5} {r.context:>6} {r.num_splits:>6} {r.kv_gib:>7.2f} "
              f"{r.paged_us:>9.1f} {r.paged_gbps:>7.0f} {r.paged_pct_of_copy:>5.0f}% "
              f"{r.sdpa_us:>9.1f} {r.sdpa_gbps:>7.0f} {r.paged_over_sdpa:>9.2f}x "
              f"{r.max_abs_diff:>8.1e} {target}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_kernels.py times GPU kernels and needs an NVIDIA GPU with CUDA; none "
              "is visible here, so there is nothing to measure. (The kernels' correctness "
              "tests run on CPU: pytest tests/kernels)", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("the Triton kernels need the triton package: pip install 'kvserve[triton]'",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.inference_mode():
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
