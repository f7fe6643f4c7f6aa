"""``--activation-precision``: which activations the packed quantised linears multiply with.

* ``int8``: each activation row rounded to int8 per group of 32 (amax/127), integer dot
  products: llama.cpp's q8 kernels (engine/cpu/csrc/quant_gemm_*.cpp). Fast, less faithful.
* ``float32`` / ``bf16``: the faithful kernels (engine/cpu/kernels_faithful.py): the same packed
  weights dequantised in registers, times float32 activations (AVX-512F, AVX2/FMA) or bfloat16
  ones (AVX-512 BF16's ``vdpbf16ps``; float32 where not built); batch-invariant as the int8
  kernels.
* ``auto`` (default), for a GGUF's packed weights: ``float32`` wherever its decode is within
  :data:`MARGIN` of the int8 path's, else ``int8`` (issue 65's rule). Measured at start
  (engine/quantization/activation_probe.py: the model's packed linears at one row, both sides
  interleaved) unless ``cpu_probe="off"``; with no clear verdict, or unmeasured, the documented
  default: ``float32`` where its kernel is the AVX-512 one (within the margin on the machines
  measured: docs/performance.md#activation-precision), ``int8`` elsewhere. Weights quantised
  on load (``int4``/``int8``) keep ``int8``.

5-bit weights (GGUF Q5_0/Q5_1) have no faithful kernel yet: they keep ``int8`` (logged).
The choice is logged at start with what was chosen and why."""

from __future__ import annotations

import logging
import time

from torch import nn

from engine.quantization.activation_probe import PassTimer
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
    why; ``auto``'s answer is the documented default, before any measurement."""
    from engine.cpu import kernels_faithful

    if requested not in ACTIVATION_PRECISIONS:
        raise ValueError(f"activation precision must be one of "
                         f"{', '.join(ACTIVATION_PRECISIONS)}, not {requested!r}")
    if requested == "int8":
        return "int8", "as requested (llama.cpp's int8 activation groups)"
    if requested == "auto" and quantization != "auto":
        return "int8", (f"auto with quantization={quantization}: the int8 kernels (and the C++ "
                        "decode stack) as before; --activation-precision float32 for the "
                        "faithful kernels")
    isa = kernels_faithful.isa()
    if isa is None:
        return "int8", "the faithful kernels are not built here (KVSERVE_CPU_KERNELS, compiler)"
    f32 = kernels_faithful.float32_isa()
    acts = "bf16" if isa == "avx512-bf16" else "float32"
    if requested == "float32":
        return "float32", f"as requested: the faithful kernel ({f32}, float32 activations)"
    if requested == "bf16":
        return "bf16", f"as requested: the faithful kernel ({isa}, {acts} activations)"
    if f32 == "avx512":
        return "float32", (f"auto: the faithful kernel ({f32}, float32 activations: the float "
                           f"model's answers), its decode within {MARGIN:.0%} of int8's on "
                           "AVX-512 (docs/performance.md#activation-precision)")
    return "int8", (f"auto: the int8 kernels; the faithful kernel ({f32}) answers like the "
                    f"float model but is not expected within {MARGIN:.0%} of int8's decode "
                    "here; --activation-precision float32 for it")


def apply_activation_precision(model: nn.Module, requested: str,
                               quantization: str = "auto",
                               time_passes: PassTimer | None = None,
                               invariant: bool = True) -> str | None:
    """Set every packed linear of ``model`` to the precision :func:`choose` picks for
    ``requested``, ``auto`` measured first with ``time_passes`` where given (module docstring;
    ``invariant``: the int8 side timed as batch invariance serves it); log what and why.
    Returns the precision (None: no packed linear)."""
    mods = packed_modules(model)
    if not mods:
        return None
    chosen, why = choose(requested, quantization)
    if requested == "auto" and quantization == "auto" and time_passes is not None \
            and "not built" not in why:
        chosen, why = _measured(mods, chosen, why, invariant, time_passes)
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


def _measured(mods: list[nn.Module], default: str, default_why: str, invariant: bool,
              time_passes: PassTimer) -> tuple[str, str]:
    """``auto``'s verdict from a measurement (activation_probe.py), or the documented default
    when the runs do not separate."""
    from engine.quantization import activation_probe as probe

    parts = probe.sampled_parts(mods)
    if not parts:
        return default, default_why
    before = [p.kernels for p in parts]
    start = time.perf_counter()

    measured = []

    def measure_once() -> probe.ActivationMeasure:
        if measured:  # again: from the int8 kernels as loaded
            for p, choice in zip(parts, before, strict=True):
                p.set_kernels(choice)
        measured.append(probe.measure(parts, invariant, time_passes))
        return measured[-1]

    got, verdict = probe.confirmed(measure_once, default, MARGIN)
    if verdict != "float32":  # back to the int8 kernels as loaded (their layouts too)
        for p, choice in zip(parts, before, strict=True):
            p.set_kernels(choice)
    logger.info("activation precision measured in %.2f s over %d packed weights%s",
                time.perf_counter() - start, len(parts),
                " (twice: a verdict against the documented default is confirmed)"
                if len(measured) > 1 else "")
    if verdict is None:
        return default, f"{default_why}; measured without a clear verdict ({got.describe()})"
    if verdict == "float32":
        return "float32", (f"auto: the faithful kernel (float32 activations: the float model's "
                           f"answers), measured within {MARGIN:.0%} of int8 ({got.describe()})")
    return "int8", (f"auto: the int8 kernels, the faithful kernel measured beyond {MARGIN:.0%} "
                    f"of them ({got.describe()}); --activation-precision float32 for it")
