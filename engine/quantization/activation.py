"""``--activation-precision``: which activations the packed quantised linears multiply with.

* ``int8``: each activation row rounded to int8 per group of 32 (amax/127), integer dot
  products: llama.cpp's q8 kernels (engine/cpu/csrc/quant_gemm_*.cpp). Fast, less faithful.
* ``float32`` / ``bf16``: the faithful kernels (engine/cpu/kernels_faithful.py): the same packed
  weights dequantised in registers, times float32 activations (AVX2/FMA) or bfloat16 ones
  (AVX-512 BF16's ``vdpbf16ps``; float32 where not built); batch-invariant as the int8 kernels.
* ``auto`` (default): the faithful path wherever its decode is within :data:`MARGIN` of the
  int8 path's, else ``int8`` (issue 65's rule; today ``int8``: the faithful kernels, in the C++
  decode stack too, are outside the margin; figures: docs/performance.md#activation-precision).
  ``float32`` is the explicit way to the float model's answers on packed weights.

5-bit weights (GGUF Q5_0/Q5_1) have no faithful kernel yet: they keep ``int8`` (logged).
The choice is logged at start with what was chosen and why."""

from __future__ import annotations

import logging

from torch import nn

from engine.quantization.linear import QuantConcat, QuantLinear

logger = logging.getLogger("kvserve.engine")

ACTIVATION_PRECISIONS = ("auto", "bf16", "float32", "int8")
# The decode slowdown (1 row, the faithful path against int8) within which the faithful path
# is the default whatever int8's agreement: proposed from docs/performance.md's measurements.
MARGIN = 0.25
INT8_AGREEMENT_TARGET = 0.99


def packed_modules(model: nn.Module) -> list[nn.Module]:
    """The model's outermost packed linears (a ``QuantConcat``, not its parts) and the packed
    embedding's head."""
    out, seen = [], set()
    for mod in model.modules():
        if id(mod) in seen:
            continue
        if isinstance(mod, (QuantConcat, QuantLinear)):
            out.append(mod)
            seen.update(id(m) for m in mod.modules())
        head = getattr(mod, "head", None)
        if isinstance(head, QuantLinear) and id(head) not in seen:
            out.append(head)
            seen.add(id(head))
    return out


def choose(requested: str, quantization: str = "auto") -> tuple[str, str]:
    """The precision for ``requested`` (one of :data:`ACTIVATION_PRECISIONS`) on this machine
    for weights of ``quantization`` (``auto``: a GGUF's packed tensors; ``int4``/``int8``:
    quantised on load, whose ``auto`` keeps the int8 kernels and the C++ decode stack), and
    why."""
    from engine.cpu import kernels_faithful

    if requested not in ACTIVATION_PRECISIONS:
        raise ValueError(f"activation precision must be one of "
                         f"{', '.join(ACTIVATION_PRECISIONS)}, not {requested!r}")
    if requested == "int8":
        return "int8", "as requested (llama.cpp's int8 activation groups)"
    if requested == "auto" and quantization != "auto":
        return "int8", (f"auto with quantization={quantization}: the int8 kernels (and the C++ "
                        "decode stack) as before; --activation-precision bf16 for the faithful "
                        "kernels")
    isa = kernels_faithful.isa()
    if isa is None:
        return "int8", "the faithful kernels are not built here (KVSERVE_CPU_KERNELS, compiler)"
    acts = "bf16" if isa == "avx512-bf16" else "float32"
    if requested == "float32":
        return "float32", f"as requested: the faithful kernel ({isa}, float32 activations)"
    if requested == "bf16":
        return "bf16", f"as requested: the faithful kernel ({isa}, {acts} activations)"
    return "int8", (f"auto: the int8 kernels; the faithful kernel ({isa}) answers like the "
                    "float model but its decode is not yet within "
                    f"{MARGIN:.0%} of int8's; --activation-precision float32 (or bf16) for it "
                    "(docs/performance.md#activation-precision)")


def apply_activation_precision(model: nn.Module, requested: str,
                               quantization: str = "auto") -> str | None:
    """Set every packed linear of ``model`` to the precision :func:`choose` picks for
    ``requested``; log what and why. Returns the precision (None: no packed linear)."""
    mods = packed_modules(model)
    if not mods:
        return None
    chosen, why = choose(requested, quantization)
    for m in mods:
        m.choose(activation=chosen)
    kept = [m for m in mods
            if any(p.kernels.activation != chosen for p in getattr(m, "parts", [m]))]
    if chosen != "int8" and len(kept) == len(mods):
        chosen, why = "int8", f"no packed weight has a faithful kernel ({why})"
    elif kept:
        why += f"; {len(kept)} packed modules keep int8 (5-bit weights: no faithful kernel)"
    logger.info("activation precision %s for %d packed modules: %s", chosen, len(mods), why)
    return chosen
