"""The useful-work yardstick (docs/design.md): FLOPs a run had to do, and the matmul peak.

Useful FLOPs of a request with P prompt tokens (C of them served from the prefix cache) and O
output tokens:

* dense:     2 · N · (P − C + O − 1)   N = non-embedding parameters; the last sampled token is
                                       never fed back, so O − 1 decode tokens are processed
* logits:    2 · hidden · vocab · O    one vocabulary projection per sampled token
* attention: Σ 4 · layers · ctx · q_dim over processed tokens, ctx = keys the token attends to
             (its position + 1); q_dim = heads · head_dim (= hidden for Llama)

Efficiency = useful FLOPs / wall time / matmul peak, the peak measured in the same run on the
model's own matmul shapes at large row counts (256 and 2048 on CPU), through F.linear and every
packed linear the engine may use, before and after the load (the highest rate counts). It bounds what any engine could do:
padding, recomputation and overheads count as waste. Shared with benchmarks/.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from loadgen.kv_calc import ModelShape


@dataclass(frozen=True)
class FlopsCount:
    dense: float
    logits: float
    attention: float

    @property
    def total(self) -> float:
        return self.dense + self.logits + self.attention

    def __add__(self, other: FlopsCount) -> FlopsCount:
        return FlopsCount(self.dense + other.dense, self.logits + other.logits,
                          self.attention + other.attention)


ZERO = FlopsCount(0.0, 0.0, 0.0)


def _sum_ctx(first: int, last: int) -> int:
    """Σ (t + 1) for t in [first, last]; 0 when the range is empty."""
    if last < first:
        return 0
    return (last + 1) * (last + 2) // 2 - first * (first + 1) // 2


def request_flops(shape: ModelShape, prompt_tokens: int, output_tokens: int,
                  cached_tokens: int = 0) -> FlopsCount:
    """Useful FLOPs of one request (see the module docstring)."""
    if prompt_tokens < 1 or output_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"bad token counts: prompt={prompt_tokens}, output={output_tokens}, "
                         f"cached={cached_tokens}")
    # A prompt's last token is always computed, whatever a server reports as cached.
    cached_tokens = min(cached_tokens, prompt_tokens - 1)
    if shape.hidden is None or shape.vocab is None:
        raise ValueError(f"model {shape.name!r} lacks hidden/vocab sizes for the FLOPs count")
    if output_tokens == 0:
        last = prompt_tokens - 1
        sampled = 0
    else:
        last = prompt_tokens + output_tokens - 2
        sampled = output_tokens
    processed = last - cached_tokens + 1
    q_dim = shape.heads * shape.head_dim
    return FlopsCount(
        dense=2.0 * shape.non_embedding_params() * processed,
        logits=2.0 * shape.hidden * shape.vocab * sampled,
        attention=4.0 * shape.layers * q_dim * _sum_ctx(cached_tokens, last))


def run_flops(shape: ModelShape, requests: Iterable[tuple[int, int, int]]) -> FlopsCount:
    """Sum over ``(prompt_tokens, output_tokens, cached_tokens)`` triples."""
    total = ZERO
    for p, o, c in requests:
        total = total + request_flops(shape, p, o, c)
    return total


@dataclass(frozen=True)
class MatmulPeak:
    """Best GFLOP/s of ``x[rows, k] @ W[k, n]`` over the probed shapes, with what was probed."""

    gflops: float
    dtype: str
    device: str
    rows: int
    shape: tuple[int, int]
    threads: int
    probes: dict[str, float]


def _probe_shapes(shape: ModelShape | None) -> list[tuple[int, int]]:
    if shape is None or shape.hidden is None or shape.intermediate is None:
        return [(576, 1536)]
    h, f = shape.hidden, shape.intermediate
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    # The engine fuses Q/K/V and gate/up (docs/design.md), so those are the shapes it actually runs.
    return [(h, qkv), (h, 2 * f), (f, h)]


def measure_matmul_peak(shape: ModelShape | None = None, dtype: str = "auto",
                        device: str = "cpu", rows: int | tuple[int, ...] | None = None,
                        seconds: float = 0.25, repeats: int = 3) -> MatmulPeak:
    """Time the model's dense matmuls and keep the best rate: the machine's compute limit.

    ``dtype="auto"`` probes float32 and, where the device runs it natively (CUDA, or a CPU with
    AVX-512 BF16 or AMX: the same test as the engine's ``dtype="auto"``), bfloat16, and keeps
    the faster (an engine free to choose its dtype could reach it); emulated bf16 on other CPUs
    measured far slower than fp32 (docs/decisions.md#small-cpu-costs) and would only make
    the probe slow. Every shape is timed through ``F.linear`` and through each packed
    linear the engine can use here (oneDNN, our AVX2 panel kernel; see
    ``engine.quantization.packed_linear``) at each row count (CPU: 256 and 2048), and the fastest of
    all counts: a peak that any implementation here reaches. Each probe is the best of
    ``repeats`` timed windows, which discounts noise from other processes on a shared machine.
    """
    import torch

    from engine.quantization.packed_linear import (
        PackedLinear,
        onednn_linear_available,
        panel_kernels_available,
    )
    from engine.runner.dtype_choice import cpu_has_bf16

    if dtype == "auto":
        dtypes = ["float32"] + (["bfloat16"] if device != "cpu" or cpu_has_bf16() else [])
    else:
        dtypes = [str(dtype).removeprefix("torch.")]
    if rows is None:
        rows = (256, 2048) if device == "cpu" else (4096,)
    row_counts = (rows,) if isinstance(rows, int) else tuple(rows)
    probes: dict[str, float] = {}
    best = (0.0, dtypes[0], (0, 0), row_counts[0])
    with torch.inference_mode():
        for dt_name in dtypes:
            dt = getattr(torch, dt_name)
            impls = ["torch"]
            if onednn_linear_available(torch.device(device), dt):
                impls.append("onednn")
            if panel_kernels_available(torch.device(device), dt):
                impls.append("avx2-panels")
            for r in row_counts:
                for k, n in _probe_shapes(shape):
                    x = torch.randn(r, k, dtype=dt, device=device)
                    w = torch.randn(n, k, dtype=dt, device=device)
                    for impl in impls:
                        fn = w if impl == "torch" else PackedLinear(w, None, impl)
                        rate = max(_time_linear(x, fn, seconds) for _ in range(repeats))
                        probes[f"{dt_name} {impl} {r}x{k}x{n}"] = rate / 1e9
                        if rate / 1e9 > best[0]:
                            best = (rate / 1e9, dt_name, (k, n), r)
    return MatmulPeak(best[0], best[1], device, best[3], best[2], torch.get_num_threads(),
                      probes)


def _time_linear(x, fn, seconds: float) -> float:
    """FLOP/s of ``fn(x)``, a ``[rows, k] -> [rows, n]`` linear (a module), or of
    ``F.linear(x, fn)`` when ``fn`` is the weight itself."""
    import torch

    if isinstance(fn, torch.Tensor):
        w = fn
        fn = lambda x: torch.nn.functional.linear(x, w)  # noqa: E731
    n_out = fn(x).shape[-1]

    def sync() -> None:
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    fn(x)
    sync()
    every = 4 if x.device.type == "cuda" else 1  # CPU calls are synchronous: check each time
    iters, start = 0, time.perf_counter()
    while True:
        fn(x)
        iters += 1
        if iters % every == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return 2.0 * x.shape[0] * x.shape[1] * n_out * iters / elapsed


def efficiency_report(flops: FlopsCount, wall_s: float, peak: MatmulPeak) -> dict:
    """The JSON-able efficiency block printed by the benches."""
    achieved = flops.total / max(wall_s, 1e-9) / 1e9
    return {"useful_gflop": flops.total / 1e9, "dense_gflop": flops.dense / 1e9,
            "logits_gflop": flops.logits / 1e9, "attention_gflop": flops.attention / 1e9,
            "wall_s": wall_s, "achieved_gflops": achieved, "peak_gflops": peak.gflops,
            "peak_dtype": peak.dtype, "peak_device": peak.device, "peak_rows": peak.rows,
            "peak_shape": list(peak.shape), "peak_threads": peak.threads,
            "peak_probes": peak.probes,
            "efficiency": achieved / peak.gflops if peak.gflops > 0 else float("nan")}


def best_peak(first: MatmulPeak, second: MatmulPeak) -> MatmulPeak:
    """The higher of two probes (before and after the load): on a shared machine the lower one
    was slowed by other work, and a low peak would overstate the efficiency."""
    return first if first.gflops >= second.gflops else second


def rescale(report: dict, peak: MatmulPeak) -> dict:
    """An ``efficiency_report`` against another peak (same work, same wall time)."""
    return report | {"peak_gflops": peak.gflops, "peak_dtype": peak.dtype,
                     "peak_device": peak.device, "peak_rows": peak.rows,
                     "peak_shape": list(peak.shape), "peak_threads": peak.threads,
                     "peak_probes": peak.probes,
                     "efficiency": report["achieved_gflops"] / peak.gflops
                     if peak.gflops > 0 else float("nan")}
