"""Resident weight bytes of llama.cpp's common GGUF mixes served packed, against the file, and
the 5-bit kernel against the alternatives at decode sizes; baselines in the same run.

Part 1 (bytes): the embedded SmolLM2-135M Q4_1 GGUF (576-wide rows: not multiples of 256, so
llama-quantize falls back to Q5_0/Q5_1/Q8_0 for most K-quant tensors) is re-quantised with
llama.cpp's own ``llama-quantize --allow-requantize`` into each mix (cached under ``--out``).
For each file: its size, the bytes of its tensors, and the weight bytes the engine holds when
it serves the file packed (``quantization=auto`` with the quantised path chosen for every batch
size): each tensor ``engine.loading.packed_policy.is_packable`` accepts at its packed form's
``nbytes``, every other tensor as a float32 copy. The baseline is the same accounting with
only the block types packed before this change (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); the
alternative is Q5_0/Q5_1 widened to the existing 8-bit form (exact too, 9/10 bits per weight
instead of 7). Prints ``resident / file`` for each.

Part 2 (``--kernels``): one pass over every Q5_0 projection of the Q4_K_M file (the
weights read from memory as in a decode step) at 1, 4 and 16 rows: the 5-bit kernel
(``quant_gemm_q5``), the same weights widened to the 8-bit form on ``quant_gemm_q8`` and
``quant_gemm_q8_vnni`` (where built), and float32 ``F.linear`` of the dequantised weights;
best of ``--reps`` passes each, alternated; ratios against the 5-bit kernel.

    PYTHONPATH=. python benchmarks/packed_types.py [--kernels] [--llama-quantize PATH]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.loading.embedded import embedded_gguf_path
from engine.loading.packed_policy import hf_name, is_packable
from engine.quantization.formats import PackedQ8
from engine.quantization.gguf_blocks import NAMES, from_gguf_blocks

MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0")
BEFORE = {2, 3, 8, 12, 13, 14}  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: packed before this change
LLAMA_CPP = (Path.home() / ".cache/kvserve/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
TARGET = 1.3


def requantised(mix: str, quantize: Path, out: Path) -> Path:
    """The embedded GGUF re-quantised to ``mix`` by llama-quantize (made once, cached)."""
    dst = out / f"smollm2-135m-{mix}.gguf"
    if not dst.is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".tmp")
        subprocess.run([str(quantize), "--allow-requantize", str(embedded_gguf_path()), str(tmp),
                        mix, "2"], check=True, capture_output=True)
        tmp.rename(dst)
    return dst


def resident(path: Path) -> dict:
    """Bytes of ``path``'s tensors in the file, as served packed now, and as before."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensor_bytes = now = before = widened_bytes = 0
    types: collections.Counter = collections.Counter()
    for t in reader.tensors:
        qtype, numel = int(t.tensor_type), int(np.prod([int(s) for s in t.shape]))
        types[NAMES.get(qtype, t.tensor_type.name)] += 1
        tensor_bytes += int(t.n_bytes)
        if is_packable(t):
            k, n = (int(s) for s in t.shape)
            nbytes = from_gguf_blocks(np.asarray(t.data), qtype, (n, k)).nbytes
        else:
            nbytes = 4 * numel
        now += nbytes
        if qtype in (6, 7) and is_packable(t):  # the 8-bit form: 1 byte, a scale (and min) per 32
            widened_bytes += numel + numel // 32 * (4 if qtype == 6 else 8)
        else:
            widened_bytes += nbytes
        before += nbytes if (qtype in BEFORE or not is_packable(t)) else 4 * numel
    return {"file": path.stat().st_size, "tensors": tensor_bytes, "now": now, "before": before,
            "widened": widened_bytes, "types": dict(types.most_common())}


def q5_weights(path: Path) -> list:
    from gguf import GGUFReader

    out = []
    for t in GGUFReader(path).tensors:
        if int(t.tensor_type) == 6 and hf_name(t.name) is not None:
            k, n = (int(s) for s in t.shape)
            out.append(from_gguf_blocks(np.asarray(t.data), 6, (n, k)))
    return out


def widened(p) -> PackedQ8:
    """A Q5_0 weight on the 8-bit form (q - 16 in -16..15, scale d): the same values."""
    n, k = p.shape
    q = p.dequantize() / p.d.repeat_interleave(32, dim=1)
    return PackedQ8(torch.round(q).to(torch.int8).contiguous(), p.d.clone())


def kernels_part(path: Path, reps: int) -> None:
    from engine.quantization.linear import quant_kernels, vnni_available

    k = quant_kernels()
    if k is None:
        print("kernels: CPU kernels unavailable")
        return
    q5 = q5_weights(path)
    q8 = [widened(p) for p in q5]
    dense = [p.dequantize() for p in q5]
    variants = {"q5 (quant_gemm_q5)": lambda x, i: k.quant_gemm_q5(x, q5[i].qs, q5[i].d, q5[i].m),
                "q8 widened (quant_gemm_q8)": lambda x, i: k.quant_gemm_q8(x, q8[i].qs, q8[i].d, None),
                "float32 F.linear": lambda x, i: F.linear(x, dense[i])}
    if vnni_available():
        variants["q8 widened (quant_gemm_q8_vnni)"] = (
            lambda x, i: k.quant_gemm_q8_vnni(x, q8[i].qs, q8[i].d, None))
    mb = {"q5": sum(p.nbytes for p in q5), "q8": sum(p.nbytes for p in q8),
          "f32": sum(w.numel() * 4 for w in dense)}
    print(f"\nkernels: {len(q5)} Q5_0 projections of {path.name}; weights {mb['q5'] / 1e6:.1f} MB "
          f"(q5) / {mb['q8'] / 1e6:.1f} MB (q8) / {mb['f32'] / 1e6:.1f} MB (float32)")
    for rows in (1, 4, 16):
        xs = {w: torch.randn(rows, w) for w in {p.shape[1] for p in q5}}
        best = {name: float("inf") for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                start = time.perf_counter()
                for i, p in enumerate(q5):
                    fn(xs[p.shape[1]], i)
                best[name] = min(best[name], time.perf_counter() - start)
        base = best["q5 (quant_gemm_q5)"]
        print(f"  {rows:2d} rows: " + "; ".join(
            f"{name} {t * 1e3:.2f} ms ({t / base:.2f}x q5)" for name, t in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-quantize", type=Path, default=LLAMA_CPP / "build/bin/llama-quantize")
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/kvserve/packed_types")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES))
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not args.llama_quantize.is_file():
        raise SystemExit(f"{args.llama_quantize} not found: build it with `cmake --build "
                         f"{LLAMA_CPP}/build --target llama-quantize` (see vs_llamacpp.sh)")
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}")
    ok = True
    for mix in args.mixes:
        path = requantised(mix, args.llama_quantize, args.out)
        r = resident(path)
        ratio, ratio_before = r["now"] / r["file"], r["before"] / r["file"]
        ok &= ratio <= TARGET
        print(f"{mix:7s} file {r['file'] / 1e6:6.1f} MB (tensors {r['tensors'] / 1e6:6.1f} MB); "
              f"resident packed {r['now'] / 1e6:6.1f} MB = {ratio:.2f}x file "
              f"(before: {r['before'] / 1e6:6.1f} MB = {ratio_before:.2f}x; Q5_0/Q5_1 widened "
              f"to 8 bits: {r['widened'] / r['file']:.2f}x); types {r['types']}")
    print(f"target resident <= {TARGET}x file: {'met' if ok else 'NOT met'}")
    if args.kernels:
        kernels_part(requantised("Q4_K_M", args.llama_quantize, args.out), args.reps)


if __name__ == "__main__":
    main()
