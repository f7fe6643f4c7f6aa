"""Which kernel serves a packed weight at each input size: the options, whether the
instructions they need are built here, and ``KernelChoice``, one frozen value holding a
weight's every choice (``QuantLinear.set_kernels``; the routes are described in
``engine.quantization.linear``). The start-up probe (``engine.quantization.probe``) measures
the choices; ``QuantConcat`` hands the same value to each of its parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DENSE_ROWS = 32  # rows above which the dequantise-then-matmul path is used
PANEL_DTYPES = (torch.float32, torch.bfloat16)
KERNELS = ("base", "vnni")  # the decode kernels of either width
Q4_PREFILL = ("panels", "int8")  # a 4-bit weight's dense path: dequantised panels or int8 tiles
Q4_BATCH = ("kernel", "tiles")  # a 4-bit weight's decode batches: the decode kernel or int8 tiles
BATCH_TILE_ROWS = 3  # the smallest batch the tiles may serve (below, the per-call repack costs)
Q4_LAYOUTS = ("rows", "blocked")  # a 4-bit weight's storage (engine/quantization/blocked.py)
Q4_TILES = ("avx2", "vnni")  # the 4-bit int8 tiles' instructions (the same floats either way)
Q8_BATCH = ("kernel", "lanes")  # an 8-bit weight's decode batches: its decode kernel, or the lanes
LANES_ROWS = 6  # the smallest batch the lanes kernel serves (a block of 16 rows costs ~the same)
Q8_LAYOUTS = ("rows", "interleaved")  # an 8-bit weight's storage (quantization/interleaved.py)
Q8_TILES = ("vnni", "amx")  # an interleaved 8-bit weight's batches: VNNI's lanes or AMX tiles
AMX_FROM = ("16", "8")  # the row counts from which AMX tiles may serve (a measured choice)
Q4_AMX = ("off", "on")  # a blocked 4-bit weight's rows from q4_amx_from on: VNNI/AVX2 or AMX
Q4_AMX_FROM = (str(DENSE_ROWS + 1), "16")  # from which rows (prefill only, or decode batches too)
# The activations' precision in the packed kernels: int8 groups (llama.cpp's q8 dot products),
# or the faithful kernels (engine/cpu/kernels_faithful.py): bf16 on AVX-512 BF16, else float32.
ACTIVATIONS = ("int8", "bf16", "float32")


def quant_kernels():
    """The compiled CPU module, or None (kernels disabled or unbuildable)."""
    from engine.cpu.kernels import load

    return load()


def interleaved_available() -> bool:
    """Whether ``quant_gemm_q8_interleaved`` was built (AVX2; AVX-512 VNNI where targeted)."""
    k = quant_kernels()
    return k is not None and bool(k.quant_gemm_q8_interleaved_available())


def amx_available() -> bool:
    """Whether ``quant_gemm_q8_interleaved``'s AMX tiles were built (the compiler targets
    AMX-INT8 on this CPU) and the OS grants this process the tile state, unless
    ``KVSERVE_CPU_AMX=0``."""
    from engine import envs

    k = quant_kernels()
    return envs.cpu_amx_enabled() and k is not None and bool(k.quant_gemm_q8_amx_available())


def vnni_available() -> bool:
    """Whether the AVX-512 VNNI kernels were built (the compiler targets VNNI on this CPU)."""
    k = quant_kernels()
    return k is not None and bool(k.quant_gemm_q4_vnni_available())


def _require_vnni() -> None:
    """A ValueError where the AVX-512 VNNI kernels are not built (a setting that needs them)."""
    if not vnni_available():
        raise ValueError("the AVX-512 VNNI kernels are not built on this CPU")


def _require_amx() -> None:
    """A ValueError where the AMX tiles are not available (a setting that needs them)."""
    if not amx_available():
        raise ValueError("the AMX tiles are not available on this CPU (they need AMX-INT8 and "
                         "the OS's permission)")


def _one_of(name: str, options: tuple[str, ...], what: str) -> str:
    """``name``, if one of ``options``; else a ValueError naming ``what`` and the options."""
    if name not in options:
        raise ValueError(f"{what} must be one of {', '.join(options)}, not {name!r}")
    return name


@dataclass(frozen=True)
class KernelChoice:
    """A packed weight's kernel choices; replace it whole (``dataclasses.replace``). Building
    one checks every value and that the instructions it needs are built on this CPU
    (ValueError). A weight ignores the fields of other formats (``QuantLinear.set_kernels``)."""

    q4_kernel: str = "base"  # 4-bit decode kernel: base (AVX2, or scalar) or vnni
    q8_kernel: str = "base"  # 8-bit decode kernel: base or vnni
    q4_prefill: str = "panels"  # 4-bit dense path: dequantised panels or int8 tiles
    q4_batch: str = "kernel"  # 4-bit decode batches from BATCH_TILE_ROWS: kernel or tiles
    q4_layout: str = "rows"  # 4-bit storage: GGUF's rows or blocked
    q4_tiles: str = "avx2"  # the 4-bit int8 tiles' instructions: avx2 or vnni
    q8_batch: str = "kernel"  # 8-bit decode batches from LANES_ROWS: kernel or lanes (VNNI)
    q8_layout: str = "rows"  # 8-bit storage: GGUF's rows or interleaved (AVX2)
    q8_tiles: str = "vnni"  # interleaved 8-bit batches from q8_amx_from rows: vnni or amx
    q8_amx_from: str = AMX_FROM[0]  # the rows from which q8_tiles "amx" serves
    q4_amx: str = Q4_AMX[0]  # blocked 4-bit inputs from q4_amx_from rows on AMX tiles
    q4_amx_from: str = Q4_AMX_FROM[0]  # the rows from which q4_amx "on" serves
    activation: str = "int8"  # int8 groups, or the faithful kernel's bf16 / float32
    panel_dtype: torch.dtype = torch.float32  # the dense path's panels: float32 or bfloat16

    def __post_init__(self) -> None:
        for name, options, what in _OPTIONS:
            _one_of(getattr(self, name), options, what)
        if self.panel_dtype not in PANEL_DTYPES:
            raise ValueError(f"panel dtype must be float32 or bfloat16, not {self.panel_dtype}")
        if "vnni" in (self.q4_kernel, self.q8_kernel, self.q4_tiles) or self.q8_batch == "lanes":
            _require_vnni()
        if self.q8_tiles == "amx" or self.q4_amx == "on":
            _require_amx()


_OPTIONS = (("q4_kernel", KERNELS, "decode kernel"), ("q8_kernel", KERNELS, "decode kernel"),
            ("q4_prefill", Q4_PREFILL, "4-bit prefill path"),
            ("q4_batch", Q4_BATCH, "4-bit batch path"), ("q4_layout", Q4_LAYOUTS, "4-bit layout"),
            ("q4_tiles", Q4_TILES, "4-bit tiles"), ("q8_batch", Q8_BATCH, "8-bit batch path"),
            ("q8_layout", Q8_LAYOUTS, "8-bit layout"), ("q8_tiles", Q8_TILES, "8-bit tiles"),
            ("q8_amx_from", AMX_FROM, "AMX row threshold"),
            ("q4_amx", Q4_AMX, "4-bit AMX tiles"),
            ("q4_amx_from", Q4_AMX_FROM, "4-bit AMX row threshold"),
            ("activation", ACTIVATIONS, "activation precision"))
