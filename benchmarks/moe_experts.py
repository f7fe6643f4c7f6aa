"""Mixture-of-experts layer on the CPU: routed rows only (grouped) vs every expert, same run.

    python benchmarks/moe_experts.py                       # tokens 1, 4, 16, 64, 256
    python benchmarks/moe_experts.py --tokens 1 16 --seconds 1

One MoE layer of a tiny-but-not-trivial config (hidden 1024, 32 experts of 512, 4 per token:
the experts-to-active ratio of Qwen3-30B-A3B's 128/8 halved) with random weights and a
random router. Four implementations per token count:

* ``float grouped``: engine.models.moe's routed-only path over float32 stacked experts (one
  gate/up and one down matmul per expert that got tokens);
* ``float all``: the dense path (every expert on every token as two batched matmuls, weighted
  by a combine matrix that is zero off the chosen experts);
* ``int4 grouped`` / ``int4 all``: the same over packed int4 experts (``quant_rtn`` groups of
  32, one ``QuantLinear`` per expert projection, the engine's packed kernels): routed rows
  only vs every expert's packed linear on every token.

Prints milliseconds per layer call (best of 3 windows, so other load on a shared machine
counts less) and the all-experts / grouped ratio for each representation. Both grouped paths
are checked against their all-experts counterpart before timing (int4: to 5% of the
largest output, the int8 rounding of activations in the decode kernels).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.models.moe import MoeExperts, PackedExperts, route  # noqa: E402
from engine.models.moe_spec import MoeSpec  # noqa: E402
from engine.quantization.moe import rtn_experts  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 32, 4, 512


def _ms(fn, seconds: float) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


def _all_packed(experts: PackedExperts, x, weights, ids):
    """Every packed expert on every token, weighted by the (mostly zero) combine matrix."""
    combine = torch.zeros(x.shape[0], experts.num_experts).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        gate, up = experts.gate_up[e](x).chunk(2, dim=-1)
        out += combine[:, e:e + 1] * experts.down[e](torch.nn.functional.silu(gate) * up)
    return out


class _Holder(torch.nn.Module):
    """What ``rtn_experts`` reads: ``moe_blocks()`` of one layer."""

    def __init__(self, experts: MoeExperts) -> None:
        super().__init__()
        self.block = torch.nn.Module()
        self.block.experts = experts

    def moe_blocks(self):
        return {0: self.block}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--seconds", type=float, default=0.9, help="timing per cell")
    args = ap.parse_args()
    torch.manual_seed(0)
    MoeSpec(EXPERTS, TOP_K, INTER, True, (True,))  # the config is a valid spec
    experts = MoeExperts(EXPERTS, HIDDEN, INTER)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.03)
        experts.down_proj.normal_(0, 0.03)
    packed = rtn_experts(_Holder(experts), "int4", 32)["layers.0.moe.experts"]
    router = torch.randn(EXPERTS, HIDDEN) * 0.05
    print(f"MoE layer: hidden {HIDDEN}, {EXPERTS} experts of {INTER}, top-{TOP_K}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'tokens':>6} {'float grouped':>14} {'float all':>10} {'ratio':>6} "
          f"{'int4 grouped':>13} {'int4 all':>9} {'ratio':>6}   (ms per layer call)")
    with torch.inference_mode():
        for t in args.tokens:
            x = torch.randn(t, HIDDEN)
            weights, ids = route(x @ router.t(), TOP_K, True)
            torch.testing.assert_close(experts(x, weights, ids),
                                       experts.dense(x, weights, ids), rtol=1e-4, atol=1e-4)
            # int4: the decode kernels round activations to int8 (few routed rows per expert)
            # where the all-experts calls may take the dequantised float path: a percent.
            got, want = packed(x, weights, ids), _all_packed(packed, x, weights, ids)
            assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
            fg = _ms(partial(experts, x, weights, ids), args.seconds)
            fa = _ms(partial(experts.dense, x, weights, ids), args.seconds)
            qg = _ms(partial(packed, x, weights, ids), args.seconds)
            qa = _ms(partial(_all_packed, packed, x, weights, ids), args.seconds)
            print(f"{t:>6} {fg:>14.2f} {fa:>10.2f} {fa / fg:>5.1f}x {qg:>13.2f} {qa:>9.2f} "
                  f"{qa / qg:>5.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
