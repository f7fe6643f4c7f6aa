"""``dtype="auto"`` on the CPU: float32 or bfloat16, chosen by timing this model's own linear
shapes on this machine, never by a CPU-flag rule (which dtype is faster depends on the machine
and the row counts: docs/decisions.md#dtype-auto-on-the-cpu).

The objective: one request of ``PREFILL_ROWS`` prompt tokens and ``DECODE_STEPS`` generated
tokens at one row each, i.e. ``t(PREFILL_ROWS rows) + DECODE_STEPS * t(1 row)`` over one layer's
projections (QKV, O, gate/up, down). Each dtype is timed alternately, best of several runs,
twice; the verdict (the better best run where the two disagree) is cached per machine
(``engine.quantization.probe_cache``, keyed by the CPU, threads, torch and the shapes).
Packed-weight checkpoints never get here: their kernels take float32 activations and their
prefill panels' dtype is probed separately (``engine.quantization.probe.probe_panels``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.arch import shape_from_hf_config
from engine.quantization import probe_cache

logger = logging.getLogger("kvserve.engine")

PREFILL_ROWS = 256
DECODE_STEPS = 128
CANDIDATES = (torch.float32, torch.bfloat16)


def layer_shapes(hf_config: Any) -> list[tuple[int, int]]:
    """``(in, out)`` of one decoder layer's projections as the engine fuses them."""
    s = shape_from_hf_config(hf_config, "probe")
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    inter = s.intermediate or 4 * h
    return [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]


def _pass_seconds(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        F.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - start


@torch.no_grad()
def time_dtypes(shapes: list[tuple[int, int]], rows: int, repeats: int = 5) -> dict[torch.dtype, float]:
    """Best seconds of a ``rows``-row pass over ``shapes`` per candidate dtype, alternated."""
    gen = torch.Generator().manual_seed(0)
    weights = {dt: [torch.randn(o, i, generator=gen).to(dt) for i, o in shapes] for dt in CANDIDATES}
    inputs = {dt: {i: torch.randn(rows, i, generator=gen).to(dt) for i, _ in shapes}
              for dt in CANDIDATES}
    best = {dt: float("inf") for dt in CANDIDATES}
    for dt in CANDIDATES:  # warm-up (oneDNN primitive creation)
        _pass_seconds(weights[dt], inputs[dt])
    for _ in range(repeats):
        for dt in CANDIDATES:
            best[dt] = min(best[dt], _pass_seconds(weights[dt], inputs[dt]))
    return best


def request_seconds(hf_config: Any) -> dict[torch.dtype, float]:
    """The objective per candidate: one layer's share of a PREFILL_ROWS-token prefill plus
    DECODE_STEPS one-row decode steps."""
    shapes = layer_shapes(hf_config)
    one = time_dtypes(shapes, 1, repeats=9)
    many = time_dtypes(shapes, PREFILL_ROWS, repeats=3)
    return {dt: many[dt] + DECODE_STEPS * one[dt] for dt in CANDIDATES}


def measured_cpu_dtype(hf_config: Any, mode: str = "cached") -> torch.dtype:
    """The faster of float32 and bfloat16 for this model on this CPU (cached per machine;
    ``mode`` is ``--cpu-probe``: ``off`` measures nothing and takes float32)."""
    if mode == "off":
        logger.info("dtype=auto: float32 (--cpu-probe off: not measured)")
        return torch.float32
    key = probe_cache.cache_key("dtype-probe|" + repr(layer_shapes(hf_config)))
    entry = probe_cache.load(key, mode)
    if entry is not None and entry.get("verdict") in ("float32", "bfloat16"):
        return getattr(torch, entry["verdict"])
    first = request_seconds(hf_config)
    second = request_seconds(hf_config)
    pick = min(CANDIDATES, key=lambda dt: min(first[dt], second[dt]))
    agree = (min(first, key=first.get) == min(second, key=second.get))
    figures = ", ".join(f"{str(dt).removeprefix('torch.')} {min(first[dt], second[dt]) * 1e3:.1f} ms"
                        for dt in CANDIDATES)
    name = str(pick).removeprefix("torch.")
    logger.info("dtype=auto: %s on this CPU (one layer's share of a %d-token prompt + %d "
                "decode steps: %s%s)", name, PREFILL_ROWS, DECODE_STEPS, figures,
                "; cached" if agree else "; the two measurements disagreed, the better best run "
                "cached; --cpu-probe force measures again")
    probe_cache.save(key, name)
    return pick
