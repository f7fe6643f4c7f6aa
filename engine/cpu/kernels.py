"""Small C++ (OpenMP, AVX2 where the CPU has it) kernels for the CPU path, built on first use.

* ``paged_decode_cpu``: decode attention reading K/V once, straight from the block pool through
  the block table. Decode attention on a CPU is bound by that read; the PyTorch route gathers
  the blocks into a padded copy and runs SDPA over it, touching the data three times.
  ``paged_decode_cpu_int8`` / ``_fp8`` / ``_int4``: the same kernel (csrc/paged_decode_vec.h)
  over 8-bit and 4-bit pools, rows unpacked in registers or once per block of keys into an L1
  buffer (int4: the rows as stored, rotated; ``int4_rotate_cpu`` and
  ``int4_quantize_rows_cpu`` are formats.py's rotation and int4 rows, bit for bit).
* ``quant_gemm_q4`` / ``quant_gemm_q8``: linears over weights kept in 4-bit / 8-bit groups of 32
  (GGUF Q4_0, Q4_1, Q4_K / Q8_0, Q5_K, Q6_K, and int4/int8 quantised on load), int8 dot
  products over a once-quantised activation row; ``quant_gemm_q4_tiled``, the same math laid
  out for decode batches and prefill (8-column blocks repacked per call);
  ``quant_gemm_q4_blocked``, that math over weights stored blocked (no repack), at any row count.
* ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rotary_``: the layer's element-wise chains in
  one pass each (PyTorch runs each as 3-5 separate passes over the activations).
* ``first_argmax_rows``: the greedy token's argmax per row in one call (one pass, threads over
  segments of the row): engine/sampling/argmax.py.
* ``DecodeStack``: a decode step's whole layer loop as one call over the kernels above (what
  the Python loop costs around them: docs/performance.md#decode-stack); see
  engine/models/cpu_decode_stack.py.

They are compiled once per machine with torch's cpp_extension (gcc + ninja) by
``engine.cpu.build`` into ``~/.cache/kvserve/cpu-kernels/<name>-<hash of sources and flags>``
(about 1 minute on two quiet cores, with a progress bar; ``benchmarks/kernel_build.py``), under
a lock that dies with its holder;
``make install`` builds them (``python -m engine.cpu.kernels``), so a first start only loads
them. They are used for float32 on CPU. If they cannot be built, ``load()`` returns None, a
warning says why, and the engine keeps the PyTorch route; a wait for another live builder past
its bound raises :class:`~engine.cpu.build.BuildWaitTimeout` (the start fails naming the folder).
``KVSERVE_CPU_KERNELS=0`` turns them off. ``KVSERVE_CPU_MARCH`` (default ``native``) builds them
for another instruction set under its own name, e.g. ``haswell`` (AVX2, no AVX-512) to run the
AVX2 paths on an AVX-512 machine (their correctness, not an AVX2 CPU's speed).
"""

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
            "int4_rows_cpu.cpp", "argmax_cpu.cpp"]
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
                        cflags=["-O3", f"-march={march}", "-fopenmp"], ldflags=["-fopenmp"])
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
