"""Batch-invariant CPU serving: a row's arithmetic does not depend on the other rows of its step.

With ``EngineConfig.batch_invariant`` (the default), greedy output of a request is the same token
for token alone or beside any other requests, whole or in prefill chunks, after a prefix-cache
hit or a recompute preemption (as vLLM's batch-invariant mode promises). Without it the linears
and attention pick kernels by the step's row count, each with its own rounding.

:func:`make_batch_invariant` fixes each row's route, after the weights are final and before the
C++ decode stack is built: packed quantised linears use one int8 kernel at every row count
(4-bit blocked, 8-bit the decode kernel; per-row activation scales, float accumulation in group
order; float fallbacks dropped); float linears (``PackedLinear``) the AVX2 panel kernel; the
torch attention backend on a CPU sends every query row through the paged decode kernel.
Not covered: plain ``nn.Linear`` (only without the CPU kernels), a oneDNN-only packed linear,
GPUs and the Triton backend. Its measured cost: docs/cpu-and-gpu.md, "Batch-invariant greedy
output"."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from engine.quantization.linear import QuantConcat, QuantLinear
from engine.quantization.packed_linear import PackedLinear

logger = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class InvarianceReport:
    """What :func:`make_batch_invariant` changed, and what it could not cover."""

    quantised: int  # packed quantised linears (QuantConcat counted once) on one kernel
    packed: int  # float PackedLinears on the panel kernel
    uncovered: tuple[str, ...]  # modules or parts left batch-dependent, by name

    def describe(self) -> str:
        text = (f"batch-invariant: {self.quantised} quantised and {self.packed} float linears "
                f"on one kernel for every row count, attention per row")
        if self.uncovered:
            more = ", ..." if len(self.uncovered) > 3 else ""
            text += f"; NOT covered: {', '.join(self.uncovered[:3])}{more}"
        return text


def make_batch_invariant(model: nn.Module, backend) -> InvarianceReport:
    """Route every linear of ``model`` and the attention ``backend`` batch-invariantly (module
    docstring); logs and returns what was changed. Call once the linears are final."""
    quantised = packed = 0
    uncovered: list[str] = []
    done: set[int] = set()
    for name, mod in model.named_modules():
        if id(mod) in done:
            continue
        if isinstance(mod, (QuantLinear, QuantConcat)):
            mod.set_batch_invariant()
            done.update(id(m) for m in mod.modules())
            quantised += 1
        elif isinstance(mod, PackedLinear):
            if mod.set_batch_invariant():
                packed += 1
            else:
                uncovered.append(f"{name} ({mod.backend})")
        elif type(mod) is nn.Linear:
            uncovered.append(f"{name} (nn.Linear)")
    if getattr(backend, "name", None) == "torch":
        backend.batch_invariant = True
    else:
        uncovered.append(f"attention ({getattr(backend, 'name', type(backend).__name__)})")
    report = InvarianceReport(quantised, packed, tuple(uncovered))
    logger.info("%s", report.describe())
    return report
