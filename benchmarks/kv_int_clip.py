"""Would calibration help the int8 / int4 KV pools? A per-head clipping search on real K/V.

fp8 pools have one scale per head, so a calibrated scale matters (``--calculate-kv-scales``).
int8 and int4 rows carry their own scales (per token and head, per group of 32), set from each
row's largest magnitude. What calibration could still choose is a clipping factor ``alpha`` per
layer, KV head and K/V: scale from ``alpha`` times the largest magnitude, the values beyond it
clipped, fewer rounding steps wasted on one outlier. This script records every layer's K and V
of the embedded model (float weights or its 4-bit GGUF weights kept packed) on the built-in
calibration text and on an unseen text, and prints the squared error of each format at each
``alpha`` relative to ``alpha = 1`` (the pools' rule), plus how often a per-head search on the
calibration text picks ``alpha < 1`` and what that choice does on the unseen text.

    PYTHONPATH=. python benchmarks/kv_int_clip.py [--weights float 4-bit] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from engine import LLM, SamplingParams
from engine.kv_storage.calibration import CALIBRATION_TEXT
from engine.kv_storage.formats import int4_group, int4_rotate
from tests.models.teacher_forced import TEXT

ALPHAS = [1.0, 0.98, 0.95, 0.9, 0.85, 0.8]


def fake_quant(x: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """``x`` ``[T, D]`` through the pool format with its scale from ``alpha * absmax``
    (int4: of the rotated row, returned rotated; the rotation is orthonormal, so errors
    compare)."""
    if kind == "int8":
        s = (x.abs().amax(-1, keepdim=True) * alpha / 127).clamp(min=2.0 ** -14).half().float()
        return (x / s).round().clamp(-127, 127) * s
    g = int4_group(x.shape[-1])
    y = int4_rotate(x).reshape(*x.shape[:-1], -1, g)
    m = y.gather(-1, y.abs().argmax(-1, keepdim=True)) * alpha
    s = (m / -8).half().float()
    inv = torch.where(s == 0, torch.zeros_like(s), 1 / s)
    q = (y * inv + 8.5).floor().clamp(0, 15)
    return int4_rotate(((q - 8) * s).reshape(x.shape))


def record(llm: LLM, text: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V ``[T, KVH, D]`` of one prefill of ``text``."""
    seen: dict[int, list] = {}

    def observe(layer, k, v):
        seen.setdefault(layer, []).append((k.detach().float().clone(), v.detach().float().clone()))

    layers = llm.engine.runner.model.layers
    for layer in layers:
        layer.kv_observer = observe
    try:
        llm.generate([llm.tokenizer.encode(text)], SamplingParams(max_tokens=1))
    finally:
        for layer in layers:
            layer.kv_observer = None
    return {i: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]))
            for i, kv in seen.items()}


def errors(kv: dict, kind: str) -> torch.Tensor:
    """Squared error ``[alphas, layers, 2 (K/V), KVH]``."""
    out = torch.zeros(len(ALPHAS), len(kv), 2, next(iter(kv.values()))[0].shape[1])
    for li, (k, v) in kv.items():
        for j, x in enumerate((k, v)):
            for h in range(x.shape[1]):
                for a, alpha in enumerate(ALPHAS):
                    out[a, li, j, h] = ((fake_quant(x[:, h], kind, alpha) - x[:, h]) ** 2).sum()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", nargs="*", default=["float", "4-bit"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["KVSERVE_QUANT_FORCE"] = "1"
    results = {}
    for weights in args.weights:
        llm = LLM(None, dtype="float32", quantization="none" if weights == "float" else "auto",
                  kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=1024)
        calib, unseen = record(llm, CALIBRATION_TEXT), record(llm, TEXT)
        for kind in ("int8", "int4"):
            ec, eu = errors(calib, kind), errors(unseen, kind)
            rel = {str(a): [float(ec[i, :, j].sum() / ec[0, :, j].sum()) for j in range(2)]
                   for i, a in enumerate(ALPHAS)}
            best = ec.argmin(dim=0)  # per layer, K/V, head: the calibration text's choice
            chosen = eu.gather(0, best.unsqueeze(0))[0].sum() / eu[0].sum()
            share = float((best > 0).float().mean())
            results[f"{weights} / {kind}"] = {"relative_error_by_alpha_KV": rel,
                                              "heads_choosing_alpha_below_1": share,
                                              "unseen_error_with_calibrated_alpha": float(chosen)}
            print(f"{weights} weights, {kind}: squared error vs alpha=1 (K, V): "
                  + ", ".join(f"{a}: {k:.3f}/{v:.3f}" for a, (k, v) in rel.items()))
            print(f"  per-head search on the calibration text picks alpha<1 for {share:.0%} of "
                  f"heads; on the unseen text that costs {float(chosen):.3f}x the error of "
                  f"alpha=1")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
