"""Batch-invariant CPU serving: a row's arithmetic does not depend on the other rows of its step.

With ``EngineConfig.batch_invariant`` (the default), greedy output of a request is the same
token for token whether it runs alone or beside any other requests, whole or in prefill chunks,
after a prefix-cache hit or after a recompute preemption (as vLLM's batch-invariant mode and
SGLang's deterministic inference promise). Without it, the linears pick a kernel by the number
of rows in the step (int8 decode kernels, int8 tiles, bfloat16 panels, float copies above a
measured row count, oneDNN above 128 rows), each with its own rounding, and attention takes
SDPA's flash kernel for prompts (queries blocked by the chunk's length) and the decode kernel
for decodes: a logit's last bits, and at a near tie the argmax, then follow the batch.

:func:`make_batch_invariant` fixes each row's route, after the weights are final and before the
C++ decode stack is built (it reads the routes):

* packed quantised linears (``QuantLinear`` / ``QuantConcat``): one int8 kernel at every row
  count (4-bit: blocked layout; 8-bit: the decode kernel), activation scales per row and group
  of 32, integer group sums, float accumulation in group order; float fallbacks dropped;
* float linears (``PackedLinear``): the AVX2 panel kernel at every row count (no oneDNN);
* attention (the torch backend on a CPU): every query row through the paged decode kernel over
  the keys up to its position (``engine.attention.torch_backend``).

What it does not cover: plain ``nn.Linear`` (MKL; only without the CPU kernels), a oneDNN-only
packed linear, GPUs and the Triton backend. The cost is measured by
benchmarks/batch_invariance.py (docs/cpu-and-gpu.md, "Batch-invariant greedy output").
"""

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
