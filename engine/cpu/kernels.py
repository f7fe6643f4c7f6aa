"""Small C++ (OpenMP, AVX2 where the CPU has it) kernels for the CPU path, built on first use:
* ``paged_decode_cpu`` (and ``_int8`` / ``_fp8`` / ``_int4``): decode attention reading K/V
  once, straight from the block pool through the block table (csrc/paged_decode_vec.h; int4
  rows as stored, rotated; ``int4_rotate_cpu`` / ``int4_quantize_rows_cpu`` are formats.py's).
* ``quant_gemm_q4`` / ``quant_gemm_q8`` (and the ``_tiled`` / ``_blocked`` layouts): linears
  over weights in 4-bit / 8-bit groups of 32, int8 dot products over a once-quantised row.
* ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rotary_``: element-wise chains, one pass each;
  ``first_argmax_rows``: the greedy argmax per row in one call (engine/sampling/argmax.py).
* ``DecodeStack``: a decode step's whole layer loop as one call (engine/models/cpu_decode_stack.py).

Built once per machine by ``engine.cpu.build`` (``make install``: ``python -m
engine.cpu.kernels``); used for float32 on CPU. Unbuildable: ``load()`` returns None, warns, and
the PyTorch route stays (a wait past its bound for another builder raises ``BuildWaitTimeout``).
``KVSERVE_CPU_KERNELS=0`` turns them off; ``KVSERVE_CPU_MARCH`` (default ``native``) builds them
for another instruction set under its own name (e.g. ``haswell`` to test the AVX2 paths)."""

from __future__ import annotations

import logging
from pathlib import Path

from engine import envs

logger = logging.getLogger("kvserve.engine")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ["bindings.cpp", "paged_decode_cpu.cpp", "fused_ops_cpu.cpp", "small_gemm_cpu.cpp",
            "quant_gemm_cpu.cpp", "quant_gemm_q4_tiled.cpp", "quant_gemm_q4_blocked.cpp",
            "quant_gemm_vnni.cpp",
            "quant_gemm_vnni_q8.cpp", "quant_gemm_q8_batch.cpp",
            "quant_gemm_q8_interleaved.cpp", "quant_gemm_q8_amx.cpp", "quant_gemm_q4_amx.cpp",
            "quant_dequant_cpu.cpp", "quant_gemm_q5.cpp",
            "kv_store_cpu.cpp", "decode_stack_cpu.cpp", "paged_decode_cpu_int4.cpp",
            "int4_rows_cpu.cpp", "argmax_cpu.cpp", "lora_cpu.cpp"]
_NAME = "kvserve_cpu_kernels"
_module = None
_failed = False


def load():
    """The compiled module, or None when it cannot be built or is disabled."""
    global _module, _failed
    if not envs.cpu_kernels_enabled():
        return None  # read on every call: an engine started with it off stays off
    if _module is not None or _failed:
        return _module
    from engine.cpu.build import BuildWaitTimeout, build

    march = envs.cpu_march()
    name = _NAME if march == "native" else f"{_NAME}_{march.replace('-', '_')}"
    try:
        _module = build(name, [_CSRC / s for s in _SOURCES], include_dir=_CSRC,
                        cflags=["-O3", f"-march={march}", "-fopenmp"], ldflags=["-fopenmp"],
                        pch="torch_lite.h")
    except BuildWaitTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        logger.warning("CPU kernels unavailable (%s); using the PyTorch route",
                       str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        _failed = True
    return _module


if __name__ == "__main__":  # ``python -m engine.cpu.kernels``: build now (make install does)
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load()
    print(f"CPU kernels: {'ready' if built is not None else 'NOT built'}")
    sys.exit(0 if built is not None else 1)
