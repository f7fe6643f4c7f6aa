"""The faithful packed kernels (issue 65): packed 4-bit / 8-bit weights times bfloat16 or
float32 activations, the weights dequantised in registers (engine/cpu/csrc/quant_faithful.cpp).

Where the int8 kernels of ``engine.cpu.kernels`` round each activation row to int8 per group of
32, these keep the activations float32 (AVX-512F, AVX2/FMA) or round them once to bfloat16
(AVX-512 BF16's ``vdpbf16ps``): the float model's answers. One kernel serves every row count
with the same per-row operations, so row ``r``'s output is bit-identical whatever the batch.
The ISA is chosen when the library is compiled (``KVSERVE_CPU_MARCH``, default ``native``) and
reported by :func:`isa` (``avx512-bf16``, ``avx512``, ``avx2``, ``scalar``) and
:func:`float32_isa`. Scales and mins are float32 or float16 (a GGUF's, kept at their size).

The library is a plain C ABI without torch headers, built once per machine by
``engine.cpu.build`` under its own name (``kvserve_faithful_kernels``), so adding it never
rebuilds the main kernels; loaded with ctypes (the call releases the GIL).
``python -m engine.cpu.kernels_faithful`` builds it."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine import envs

logger = logging.getLogger("kvserve.engine")
_SOURCE = Path(__file__).parent / "csrc" / "quant_faithful.cpp"
_NAME = "kvserve_faithful_kernels"
ISAS = {3: "avx512", 2: "avx512-bf16", 1: "avx2", 0: "scalar"}
_lib = None
_failed = False


def load():
    """The loaded library (ctypes), or None when the CPU kernels are off or it cannot be
    built (a warning says why)."""
    global _lib, _failed
    if not envs.cpu_kernels_enabled():
        return None
    if _lib is not None or _failed:
        return _lib
    from engine.cpu.build import BuildWaitTimeout, build

    march = envs.cpu_march()
    name = _NAME if march == "native" else f"{_NAME}_{march.replace('-', '_')}"
    try:
        path = build(name, [_SOURCE], cflags=["-O3", f"-march={march}", "-fopenmp",
                                              "-ffp-contract=off"],
                     ldflags=["-fopenmp"],
                     is_python_module=False)
        lib = ctypes.CDLL(path)
    except BuildWaitTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means: no faithful path
        logger.warning("faithful packed kernels unavailable (%s)",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        _failed = True
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvf_isa.restype = ctypes.c_int
    lib.kvf_gemm_q4.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.kvf_gemm_q4.restype = None
    lib.kvf_gemm_q8.argtypes = [p, i64, i64, p, p, p, i64, i64, p, ctypes.c_int]
    lib.kvf_gemm_q8.restype = None
    _lib = lib
    return _lib


def isa() -> str | None:
    """The instructions the faithful kernels were built for (module docstring), or None."""
    lib = load()
    return None if lib is None else ISAS[lib.kvf_isa()]


def float32_isa() -> str | None:
    """The instructions float32 activations run on: ``avx512`` (AVX-512F: a nibble's weight
    looked up from a per-group table in one permute, 16 lanes), ``avx2`` or ``scalar``; None
    when the kernels are not built."""
    got = isa()
    return "avx512" if got in ("avx512", "avx512-bf16") else got


def bf16_available() -> bool:
    """Whether the bf16-activation path (AVX-512 BF16) was built."""
    return isa() == "avx512-bf16"


def kernel_address(bits: int) -> int:
    """The address of the C kernel for ``bits``-bit weights (4: ``kvf_gemm_q4``, 8:
    ``kvf_gemm_q8``), which the C++ decode stack calls directly (its faithful StackLinear
    kinds); the library stays loaded for the process's life."""
    lib = load()
    if lib is None:
        raise RuntimeError("the faithful packed kernels are not built")
    fn = {4: lib.kvf_gemm_q4, 8: lib.kvf_gemm_q8}[bits]
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
         bf16: bool = True) -> torch.Tensor:
    """``x [M, K] @ W.T`` (float32 ``[M, N]``, no bias) for a packed ``W`` in the rows layout:
    4-bit (``qs`` uint8 ``[N, K/2]``, ``d``/``m`` ``[N, K/32]``) or 8-bit (``qs`` int8
    ``[N, K]``, ``d`` ``[N, K/S]``, ``m`` like it or None); ``d`` and ``m`` float32, or float16
    both (a GGUF's scales, kept at their size: fewer bytes per decode step). ``bf16``: round the
    activations to bfloat16 where :func:`bf16_available` (else float32 activations)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the faithful packed kernels are not built")
    x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows == 0:
        return out
    flags = scale_flags(d, m) | (FLAG_BF16 if bf16 else 0)
    if qs.dtype == torch.uint8:
        if qs.shape[1] * 2 != k or d.shape != (n, k // 32):
            raise ValueError(f"a 4-bit weight {tuple(qs.shape)} does not fit input width {k}")
        lib.kvf_gemm_q4(x.data_ptr(), rows, k, qs.data_ptr(), d.data_ptr(), _ptr(m), n,
                        out.data_ptr(), flags)
    else:
        if qs.shape[1] != k or k % d.shape[1] or k // d.shape[1] not in (16, 32):
            raise ValueError(f"an 8-bit weight {tuple(qs.shape)} does not fit input width {k}")
        lib.kvf_gemm_q8(x.data_ptr(), rows, k, qs.data_ptr(), d.data_ptr(), _ptr(m),
                        k // d.shape[1], n, out.data_ptr(), flags)
    return out


FLAG_BF16 = 1  # the C entry points' flags (quant_faithful.cpp)
FLAG_HALF_SCALES = 2


def scale_flags(d: torch.Tensor, m: torch.Tensor | None) -> int:
    """The flag for scales ``d`` and mins ``m`` (contiguous, float32 or float16 both), or
    ValueError."""
    if d.dtype not in (torch.float32, torch.float16) or (m is not None and m.dtype != d.dtype):
        raise ValueError(f"faithful kernels take float32 or float16 scales and mins of one "
                         f"dtype, not {d.dtype} / {None if m is None else m.dtype}")
    if not d.is_contiguous() or (m is not None and not m.is_contiguous()):
        raise ValueError("faithful kernels take contiguous scales and mins")
    return FLAG_HALF_SCALES if d.dtype == torch.float16 else 0


def compact_scales(d: torch.Tensor, m: torch.Tensor | None):
    """Rows-layout ``(d, m)`` as float16 where that is exact (a GGUF's scales), else as they
    are: the faithful kernels read either."""
    d16 = d.half()
    if not torch.equal(d16.float(), d.float()):
        return d, m
    if m is None:
        return d16, None
    m16 = m.half()
    return (d16, m16) if torch.equal(m16.float(), m.float()) else (d, m)


if __name__ == "__main__":  # ``python -m engine.cpu.kernels_faithful``: build now
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"faithful packed kernels: {isa() or 'NOT built'}")
    sys.exit(0 if load() is not None else 1)
