"""The pass timer of ``--activation-precision auto``'s measurement
(engine/quantization/activation_probe.py): the packed parts as the C++ decode stack calls them
(``StackLinear``, engine/models/cpu_decode_stack.py), one pass timed in C++ with no Python
between the calls, so that the measurement sees the kernels a decode step runs and not the
modules' Python dispatch (which costs more than a small linear's kernel). Where the stack
cannot describe a part, or the kernels lack the timer, the parts' modules are timed instead."""

from __future__ import annotations

import torch

from engine.models.cpu_decode_stack import stack_linear
from engine.quantization.activation_probe import module_passes
from engine.quantization.linear import QuantLinear


def stack_passes(parts: list[QuantLinear], xs: dict[int, torch.Tensor],
                 passes: int) -> list[float]:
    """Seconds of each of ``passes`` passes over ``parts`` (``activation_probe.PassTimer``)."""
    from engine.cpu.kernels import load

    kernels = load()
    if kernels is None or not hasattr(kernels, "time_stack_linears"):
        return module_passes(parts, xs, passes)
    specs = [stack_linear(kernels, p) for p in parts]
    if any(isinstance(s, str) for s in specs):
        return module_passes(parts, xs, passes)
    return list(kernels.time_stack_linears([s.spec for s in specs],
                                           [xs[p.in_features] for p in parts], passes))
