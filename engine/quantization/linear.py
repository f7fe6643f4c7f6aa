"""Linear layers and embeddings over weights kept packed (``engine.quantization.formats``).

``QuantLinear(packed, bias)`` computes ``y = x @ W.T + b`` for ``W`` in 4-bit, 5-bit or 8-bit
groups (8-bit: scales per 32 or 16, optional mins). 5-bit weights (GGUF's Q5_0/Q5_1) have one
decode kernel, ``quant_gemm_q5`` (engine/cpu/csrc/quant_gemm_q5.cpp: the same int8 math, VNNI's
dot product where built), and otherwise take the dequantised panels; the 4-bit and 8-bit
settings below leave them alone:

* up to ``dense_rows`` rows (decode steps): the C++ kernels ``quant_gemm_q4`` / ``quant_gemm_q8``
  (engine/cpu/csrc/quant_gemm_cpu.cpp; ``quant_gemm_q4_vnni`` / ``quant_gemm_q8_vnni`` where the
  CPU has AVX-512 VNNI and the start-up probe measured them faster), which quantise each activation
  row to int8 per group of 32 and take integer dot products. The result differs from float by the activation's
  rounding (at most half a step of ``amax/127`` per element, per group), as llama.cpp's does.
  For 4-bit weights, batches from ``BATCH_TILE_ROWS`` rows run ``quant_gemm_q4_tiled`` instead
  where the start-up probe measured it faster (``q4_batch`` ``tiles``):
  the same integer sums, added in float in another order, so a sequence's logits can differ in
  the last bits with the size of the batch it decodes in (as with vLLM's or llama.cpp's kernels).
  Likewise 8-bit weights from ``LANES_ROWS`` rows on ``quant_gemm_q8_batch`` where it is built
  (AVX-512 VNNI) and the start-up probe measured it faster (``q8_batch`` ``lanes``;
  engine/cpu/csrc/quant_gemm_q8_batch.cpp: a batch's rows in a register's lanes, a big logits
  head ~3x faster at 16 rows).
* above (prefill), 4-bit weights where the start-up probe measured it faster (``q4_prefill``
  ``int8``, usual on AVX2-only CPUs): ``quant_gemm_q4_tiled``, the decode
  kernels' integer math laid out for many rows (engine/cpu/csrc/quant_gemm_q4_tiled.cpp).
* otherwise above: panels of ``PANEL_ROWS`` output rows are dequantised to ``panel_dtype``
  (float32, or bfloat16 where the start-up probe measured a bf16 matmul faster, usual on CPUs
  with AMX/AVX-512 BF16; the activations are rounded to bf16 for it, the output
  stays float32) and multiplied densely; compute-bound there, so the dequantisation is a small
  extra.
* 4-bit weights can be stored blocked instead (``q4_layout`` ``blocked``,
  engine/quantization/blocked.py: 8 output columns' groups interleaved) where the start-up probe
  measured it faster: then ``quant_gemm_q4_blocked`` serves every decode-sized input (the
  tiles' math without their per-call repack) and the int8 prefill; panels are
  dequantised from that layout. ``q4_kernel`` and ``q4_batch`` then have no effect.
* the int8 tiles of both 4-bit layouts run on AVX-512 VNNI's dot product (``q4_tiles``
  ``vnni``) where it is built and the start-up probe measured it faster: the same integer
  sums and floats as the AVX2 tiles, bit for bit.
* 8-bit weights can be stored interleaved instead (``q8_layout`` ``interleaved``,
  engine/quantization/interleaved.py: 16 outputs' weights interleaved by 4 bytes) where the
  start-up probe measured it faster: then ``quant_gemm_q8_interleaved`` serves every
  decode-sized input, one row or a batch (16 outputs in a register's lanes on AVX-512 VNNI,
  8 per register on AVX2, a row's 4 activation bytes broadcast: a row costs what its weights
  take to stream, a batch ~3x (VNNI) or ~1.3x (AVX2) less than the decode kernel), in the
  lanes kernel's float order, bit for bit, on either instruction set; panels are dequantised
  from that layout. ``q8_kernel`` and ``q8_batch`` then have no effect.
* interleaved 8-bit weights run batches of ``amx_from`` rows and more on AMX int8 tiles instead
  (``q8_tiles`` ``amx``, where built and the OS grants the tile state: Sapphire Rapids and
  later Xeons) where the start-up probe measured them faster, ``q8_amx_from`` (16 or 8 rows)
  measured too: the same kernel's floats, bit for bit (engine/cpu/csrc/quant_gemm_q8_amx.cpp:
  a Gemma 3 270M-shaped model's 262k-row Q8_0 head ~1.5x faster at 16 rows).
* blocked 4-bit weights run inputs of ``q4_amx_from`` rows and more (a prefill; with
  ``q4_amx_from`` 16, decode batches of 16 too) on AMX int8 tiles (``q4_amx`` ``on``, where
  built and granted) where the start-up probe measured them faster: the same floats as the
  int8 tiles, bit for bit, so batch-invariant mode keeps them (engine/cpu/csrc/
  quant_gemm_q4_amx.cpp: a 2,048-row prefill chunk's projections ~1.5-2x faster than VNNI).
* with a ``fallback`` (the float module it replaces, kept when the start-up probe found the
  quantised path slower for batches on this machine): inputs of more than ``float_above`` rows
  go to the fallback instead, so every row count runs on the path measured faster (what
  the probe found on the development machines: docs/performance.md#quantised-linears).
* batch-invariant (:meth:`QuantLinear.set_batch_invariant`, ``EngineConfig.batch_invariant``):
  one kernel for every row count, whose per-row arithmetic does not depend on the other rows:
  4-bit weights stored blocked and served by ``quant_gemm_q4_blocked`` (its 1-, 2- and 3-row
  tiles do the same operations per row, in group order), 8-bit weights by their decode kernel
  (tiles of 1-4 rows, the same operations per row) or, stored interleaved, by
  ``quant_gemm_q8_interleaved`` (the same operations per row); no float fallback, no panels.
  Row ``r``'s output is then bit-identical whatever the number of rows
  (tests/models/test_batch_invariance.py).

* faithful activations (:meth:`QuantLinear.set_activation` ``bf16``, the default through
  ``--activation-precision auto``, engine/quantization/activation.py): every decode-sized input,
  and in batch-invariant mode every input, goes to ``engine.cpu.kernels_faithful.gemm`` (the
  weights, rows layout, dequantised in registers times bf16 activations on AVX-512 BF16, float32
  elsewhere; no int8 rounding of the activations); the settings above then only matter for
  5-bit weights, which keep int8.

``QuantEmbedding`` looks ids up by dequantising only those rows; tied to the logits head, both
share one packed tensor. Float32 CPU only; the packed tensors are buffers (they count in the
module's ``buffers()`` and move with it, they are not parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.blocked import from_blocked, to_blocked
from engine.quantization.formats import Packed, PackedQ4, PackedQ5
from engine.quantization.interleaved import (
    OUTS,
    from_interleaved,
    gather_interleaved,
    gather_rows,
    to_interleaved,
)

DENSE_ROWS = 32  # rows above which the dequantise-then-matmul path is used
PANEL_ROWS = 4096  # output rows dequantised at a time on that path (bounds the temporary)
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


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` over a packed ``W [out, in]``; inputs ``[..., in]`` float32."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None = None,
                 dense_rows: int = DENSE_ROWS) -> None:
        super().__init__()
        self._kernels = quant_kernels()
        if self._kernels is None:
            raise RuntimeError("quantised linears need the CPU kernels (KVSERVE_CPU_KERNELS)")
        self.out_features, self.in_features = packed.shape
        self.is_q4 = isinstance(packed, PackedQ4)
        self.is_q5 = isinstance(packed, PackedQ5)
        self.register_buffer("qs", packed.qs)
        self.register_buffer("d", packed.d)
        self.register_buffer("m", packed.m)  # q8: None unless the format has mins (Q5_K)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.dense_rows = dense_rows
        self.fallback: nn.Module | None = None
        self.float_above: int | None = None
        self.panel_dtype = torch.float32
        self._gemm = self._kernels.quant_gemm_q4 if self.is_q4 else self._kernels.quant_gemm_q8
        if self.is_q5:
            self._gemm = self._kernels.quant_gemm_q5
        self.q4_kernel = self.q8_kernel = "base"
        self.q4_prefill = "panels"
        self.q4_batch = "kernel"
        self.q4_layout = "rows"
        self.q4_tiles = "avx2"
        self.q8_batch = "kernel"
        self.q8_layout = "rows"
        self.q8_tiles = "vnni"
        self.q8_amx_from = AMX_FROM[0]
        self.q4_amx = Q4_AMX[0]
        self.q4_amx_from = Q4_AMX_FROM[0]
        self.batch_invariant = False
        self.activation = "int8"

    def set_batch_invariant(self) -> None:
        """Serve every row count with one kernel whose per-row arithmetic (int8 activation
        scales per row and group, integer group sums, float accumulation in a fixed order) does
        not depend on how many rows share the call: 4-bit weights move to the blocked layout
        (``quant_gemm_q4_blocked``), 8-bit weights keep their decode kernel (or, stored
        interleaved, ``quant_gemm_q8_interleaved``); a float fallback is dropped. Irreversible
        (the prefill panels and per-size routes are not used again)."""
        self.set_q4_layout("rows" if self.faithful else "blocked")
        self.fallback = self.float_above = None
        self.batch_invariant = True

    @property
    def faithful(self) -> bool:
        """Whether the faithful kernel (:meth:`set_activation`) serves this weight."""
        return self.activation != "int8"

    def set_activation(self, name: str) -> bool:
        """The activations' precision: ``int8`` (the int8 kernels above), ``bf16`` or
        ``float32``: the faithful kernel (``engine.cpu.kernels_faithful.gemm``: the weights
        dequantised in registers times bf16 activations on AVX-512 BF16 (float32 ones on other
        CPUs), or float32 activations, everywhere) for every
        decode-sized input, every input in batch-invariant mode (one kernel, the same per-row
        operations at any row count); the weight returns to the rows layout. 5-bit weights
        and a build without the faithful kernels keep ``int8``. Returns whether it applies."""
        _one_of(name, ACTIVATIONS, "activation precision")
        if name != "int8":
            from engine.cpu import kernels_faithful

            if self.is_q5 or kernels_faithful.load() is None:
                return False
            self.set_q4_layout("rows")
            self.set_q8_layout("rows")
        self.activation = name
        return True

    def set_q4_kernel(self, name: str) -> None:
        """Which decode kernel a 4-bit weight uses: ``base`` (``quant_gemm_q4``: AVX2, or scalar)
        or ``vnni`` (``quant_gemm_q4_vnni``, where built). 8-bit weights ignore it."""
        self._check_kernel(name)
        self.q4_kernel = name
        if self.is_q4:
            self._gemm = (self._kernels.quant_gemm_q4_vnni if name == "vnni"
                          else self._kernels.quant_gemm_q4)

    def set_q8_kernel(self, name: str) -> None:
        """As :meth:`set_q4_kernel` for 8-bit weights (``quant_gemm_q8`` or
        ``quant_gemm_q8_vnni``); 4-bit and 5-bit weights ignore it."""
        self._check_kernel(name)
        self.q8_kernel = name
        if not self.is_q4 and not self.is_q5:
            self._gemm = (self._kernels.quant_gemm_q8_vnni if name == "vnni"
                          else self._kernels.quant_gemm_q8)

    def set_q4_prefill(self, name: str) -> None:
        """A 4-bit weight's dense (prefill) path: ``panels`` (dequantised, ``panel_dtype``) or
        ``int8`` (``quant_gemm_q4_tiled``: the decode kernels' int8 math, tiled). 8-bit weights
        ignore it."""
        self.q4_prefill = _one_of(name, Q4_PREFILL, "4-bit prefill path")

    def set_q4_batch(self, name: str) -> None:
        """A 4-bit weight's decode batches of ``BATCH_TILE_ROWS`` to ``dense_rows`` rows:
        ``kernel`` (the decode kernel) or ``tiles`` (``quant_gemm_q4_tiled``: the same integer
        math in another float summation order). 8-bit weights ignore it."""
        self.q4_batch = _one_of(name, Q4_BATCH, "4-bit batch path")

    def set_q8_batch(self, name: str) -> None:
        """An 8-bit weight's decode batches of ``LANES_ROWS`` to ``dense_rows`` rows:
        ``kernel`` (its decode kernel) or ``lanes`` (``quant_gemm_q8_batch``, AVX-512 VNNI
        only: 16 rows in a register's lanes; the same integer sums in another float order, each
        output in its own fixed order). Not in batch-invariant mode (one kernel for every row
        count: the decode kernel); 4-bit and 5-bit weights ignore it."""
        _one_of(name, Q8_BATCH, "8-bit batch path")
        if name == "lanes":
            _require_vnni()
        self.q8_batch = name

    @property
    def is_q8(self) -> bool:
        return not self.is_q4 and not self.is_q5

    @property
    def lanes_from(self) -> int | None:
        """The row count from which decode-sized inputs of an 8-bit weight run
        ``quant_gemm_q8_batch`` (None: never)."""
        return LANES_ROWS if self.is_q8 and self.q8_batch == "lanes" \
            and not self.batch_invariant and not self.interleaved else None

    def set_q8_layout(self, name: str) -> None:
        """An 8-bit weight's storage: ``rows`` (GGUF's) or ``interleaved`` (where
        ``quant_gemm_q8_interleaved`` is built: AVX2; served by it at every decode size, in the
        float order of ``quant_gemm_q8_batch``); converted in place, exactly, one copy of the
        weight at a time. 4-bit and 5-bit weights ignore it."""
        _one_of(name, Q8_LAYOUTS, "8-bit layout")
        if not self.is_q8 or name == self.q8_layout:
            return
        if name == "interleaved":
            if not interleaved_available():
                raise ValueError("the interleaved 8-bit kernel is not built on this CPU (it "
                                 "needs AVX2)")
            self.qs, self.d, self.m = to_interleaved(self.qs, self.d, self.m)
        else:
            self.qs, self.d, self.m = from_interleaved(self.qs, self.d, self.m,
                                                       self.out_features)
        self.q8_layout = name

    @property
    def interleaved(self) -> bool:
        """Whether the weight is stored interleaved (:meth:`set_q8_layout`)."""
        return self.q8_layout == "interleaved"

    def set_q8_tiles(self, name: str) -> None:
        """An interleaved 8-bit weight's batches from :attr:`amx_from` rows: ``vnni`` (the
        kernel's AVX-512 VNNI lanes) or ``amx`` (its AMX int8 tiles, where
        :func:`amx_available`). The same floats either way, bit for bit (batch-invariant
        included): only the speed differs. Other weights ignore it."""
        _one_of(name, Q8_TILES, "8-bit tiles")
        if name == "amx":
            _require_amx()
        self.q8_tiles = name

    def set_q8_amx_from(self, rows: str) -> None:
        """The smallest row count (one of :data:`AMX_FROM`) that ``q8_tiles == "amx"`` sends
        to the AMX tiles."""
        self.q8_amx_from = _one_of(rows, AMX_FROM, "AMX row threshold")

    def set_q4_amx(self, name: str) -> None:
        """A blocked 4-bit weight's inputs of :attr:`amx_from` rows and more: ``off`` (the
        int8 tiles of ``q4_tiles``) or ``on`` (AMX int8 tiles, where :func:`amx_available`).
        The same floats either way, bit for bit (batch-invariant included): only the speed
        differs. Other weights (and the rows layout) ignore it."""
        _one_of(name, Q4_AMX, "4-bit AMX tiles")
        if name == "on":
            _require_amx()
        self.q4_amx = name

    def set_q4_amx_from(self, rows: str) -> None:
        """The smallest row count (one of :data:`Q4_AMX_FROM`) that ``q4_amx == "on"`` sends
        to the AMX tiles."""
        self.q4_amx_from = _one_of(rows, Q4_AMX_FROM, "4-bit AMX row threshold")

    @property
    def amx_from(self) -> int | None:
        """The row count from which this weight runs on AMX tiles (None: never): an
        interleaved 8-bit weight's ``q8_amx_from`` (``q8_tiles == "amx"``), a blocked 4-bit
        weight's ``q4_amx_from`` (``q4_amx == "on"``)."""
        if self.interleaved and self.q8_tiles == "amx":
            return int(self.q8_amx_from)
        if self.is_q4 and self.blocked and self.q4_amx == "on":
            return int(self.q4_amx_from)
        return None

    def _on_amx(self, rows: int) -> bool:
        return self.amx_from is not None and rows >= self.amx_from

    def set_q4_tiles(self, name: str) -> None:
        """The 4-bit int8 tiles' instructions (``quant_gemm_q4_tiled`` and
        ``quant_gemm_q4_blocked``): ``avx2`` (maddubs) or ``vnni`` (AVX-512 VNNI's dpbusd,
        where built). The same integer sums and floats either way, bit for bit: only the speed
        differs. Other weights ignore it."""
        _one_of(name, Q4_TILES, "4-bit tiles")
        if name == "vnni":
            _require_vnni()
        self.q4_tiles = name

    def set_q4_layout(self, name: str) -> None:
        """A 4-bit weight's storage: ``rows`` (GGUF's) or ``blocked`` (served by
        ``quant_gemm_q4_blocked`` at every decode size); converted in place, exactly, one copy
        of the weight at a time. 8-bit weights ignore it."""
        _one_of(name, Q4_LAYOUTS, "4-bit layout")
        if not self.is_q4 or name == self.q4_layout:
            return
        if name == "blocked":
            self.qs, self.d, self.m = to_blocked(self.qs, self.d, self.m)
        else:
            self.qs, self.d, self.m = from_blocked(self.qs, self.d, self.m, self.out_features)
        self.q4_layout = name

    @property
    def blocked(self) -> bool:
        """Whether the weight is stored blocked (:meth:`set_q4_layout`)."""
        return self.q4_layout == "blocked"

    @property
    def tiles_from(self) -> int | None:
        """The row count from which decode-sized inputs run the tiles (None: never; a blocked
        weight has its own kernel for every row count)."""
        return BATCH_TILE_ROWS if self.is_q4 and self.q4_batch == "tiles" and not self.blocked \
            else None

    @staticmethod
    def _check_kernel(name: str) -> None:
        _one_of(name, KERNELS, "decode kernel")
        if name == "vnni":
            _require_vnni()

    def keep_float_above(self, rows: int, fallback: nn.Module) -> None:
        """Send inputs of more than ``rows`` rows to ``fallback`` (same weights, float)."""
        self.fallback, self.float_above = fallback, rows

    def set_panel_dtype(self, dtype: torch.dtype) -> None:
        """The dtype of the dense path's dequantised panels and matmul (float32 or bfloat16)."""
        if dtype not in PANEL_DTYPES:
            raise ValueError(f"panel dtype must be float32 or bfloat16, not {dtype}")
        self.panel_dtype = dtype

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``W[rows]`` as float32 (or bfloat16)."""
        bf16 = dtype == torch.bfloat16
        if self.interleaved:
            qs, d, m = gather_rows(self.qs, self.d, self.m, rows.reshape(-1))
            return self._kernels.quant_dequant_q8(qs, d, m, torch.arange(rows.numel()), bf16)
        if self.blocked:
            return self._kernels.quant_dequant_q4_blocked(self.qs, self.d, self.m, rows, bf16)
        if self.is_q4:
            return self._kernels.quant_dequant_q4(self.qs, self.d, self.m, rows, bf16)
        if self.is_q5:
            return self._kernels.quant_dequant_q5(self.qs, self.d, self.m, rows, bf16)
        return self._kernels.quant_dequant_q8(self.qs, self.d, self.m, rows, bf16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.fallback is not None and x2.shape[0] > self.float_above:
            return self.fallback(x).view(*lead, self.out_features)
        rows = x2.shape[0]
        if self.faithful and (self.batch_invariant or rows <= self.dense_rows):
            out = self._faithful(x2, self.qs, self.d, self.m)
        elif self.interleaved and (self.batch_invariant or rows <= self.dense_rows):
            out = self._kernels.quant_gemm_q8_interleaved(x2, self.qs, self.d, self.m,
                                                          self.out_features,
                                                          amx=self._on_amx(rows))
        elif self._on_lanes(rows):
            out = self._kernels.quant_gemm_q8_batch(x2, self.qs, self.d, self.m)
        elif self.batch_invariant:
            out = self.tiles(x2) if self.is_q4 else self._gemm(x2, self.qs, self.d, self.m)
        elif self._on_tiles(rows):
            out = self.tiles(x2)
        elif rows <= self.dense_rows:
            out = self._gemm(x2, self.qs, self.d, self.m)
        else:
            out = self._dense(x2)
        if self.bias is not None:
            out += self.bias
        return out.view(*lead, self.out_features)

    def forward_columns(self, x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor | None:
        """``forward(x)[..., columns]`` computed for those output features only, bit for bit,
        or None where this weight cannot promise that. The decode kernels compute every output
        from its own weight row and the row of ``x``, in a fixed order, whatever the other
        rows: so on their route (a batch-invariant 8-bit or 5-bit weight, or any weight in
        rows layout at a row count its decode kernel serves) the gathered rows give the same
        numbers; so does ``quant_gemm_q8_batch`` on the 8-bit lanes route, and
        ``quant_gemm_q8_interleaved`` on the gathered outputs of an interleaved weight. The
        blocked 4-bit layout, the tiles and the dense panels are not gathered (None). Used by a
        logits head under a grammar that allows few tokens."""
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if not self.faithful and (self.blocked or self.fallback is not None
                                  or self._on_tiles(rows)):
            return None
        if not self.batch_invariant and rows > self.dense_rows:
            return None
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.faithful:
            m = None if self.m is None else self.m.index_select(0, columns)
            out = self._faithful(x2, self.qs.index_select(0, columns),
                                 self.d.index_select(0, columns), m)
        elif self.interleaved:
            qs, d, m = gather_interleaved(self.qs, self.d, self.m, columns)
            out = self._kernels.quant_gemm_q8_interleaved(x2, qs, d, m, columns.numel(),
                                                          amx=self._on_amx(rows))
        else:
            m = None if self.m is None else self.m.index_select(0, columns)
            gemm = self._kernels.quant_gemm_q8_batch if self._on_lanes(rows) else self._gemm
            out = gemm(x2, self.qs.index_select(0, columns), self.d.index_select(0, columns), m)
        if self.bias is not None:
            out += self.bias.index_select(0, columns)
        return out.view(*x.shape[:-1], columns.numel())

    def _faithful(self, x2: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                  m: torch.Tensor | None) -> torch.Tensor:
        from engine.cpu import kernels_faithful

        return kernels_faithful.gemm(x2, qs, d, m, bf16=self.activation == "bf16")

    def _on_lanes(self, rows: int) -> bool:
        """Whether ``rows`` rows run ``quant_gemm_q8_batch`` (8-bit weights only)."""
        return self.lanes_from is not None and self.lanes_from <= rows <= self.dense_rows

    def _on_tiles(self, rows: int) -> bool:
        """Whether ``rows`` rows run the int8 tiles (4-bit weights only): every decode size of
        a blocked weight, a decode batch from ``tiles_from`` rows, or a prefill with
        ``q4_prefill == "int8"``."""
        if rows <= self.dense_rows:
            return self.blocked or (self.tiles_from is not None and rows >= self.tiles_from)
        return self.is_q4 and self.q4_prefill == "int8" and not self.faithful

    def tiles(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, in] @ W.T`` (float32, no bias) on the 4-bit int8 tiles over this weight's
        layout (blocked, or repacked per call), on the instructions of ``q4_tiles`` (a blocked
        weight's inputs from :attr:`amx_from` rows on AMX tiles)."""
        vnni = self.q4_tiles == "vnni"
        if self.blocked:
            return self._kernels.quant_gemm_q4_blocked(x2, self.qs, self.d, self.m,
                                                       self.out_features, vnni,
                                                       self._on_amx(x2.shape[0]))
        return self._kernels.quant_gemm_q4_tiled(x2, self.qs, self.d, self.m, vnni)

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        dt = self.panel_dtype
        xin = x2 if dt == torch.float32 else x2.to(dt)
        if self.out_features <= PANEL_ROWS:
            return F.linear(xin, self.dequantize_rows(torch.arange(self.out_features), dt)).float()
        out = torch.empty(x2.shape[0], self.out_features)
        for start in range(0, self.out_features, PANEL_ROWS):
            stop = min(start + PANEL_ROWS, self.out_features)
            out[:, start:stop] = F.linear(xin, self.dequantize_rows(torch.arange(start, stop), dt))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (and bias); a float fallback is not counted."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        if self.is_q4:
            kind = "q4 blocked" if self.blocked else "q4"
        elif self.is_q5:
            kind = "q5"
        else:
            groups = self.d.shape[1] // (OUTS if self.interleaved else 1)
            kind = f"q8/{self.in_features // groups}" + ("+m" if self.m is not None else "") \
                + (" interleaved" if self.interleaved else "")
        above = "" if self.fallback is None else f", float above {self.float_above} rows"
        return f"in={self.in_features}, out={self.out_features}, {kind}{above}"


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


class QuantConcat(nn.Module):
    """A fused projection whose parts are packed in different formats (a Q4_K_M file stores Q
    and K as Q4_K but V as Q6_K): ``y = [x @ W_0.T + b_0 | x @ W_1.T + b_1 | ...]``, one
    ``QuantLinear`` per run of parts in one layout. The same interface as ``QuantLinear``
    (``in_features``, ``out_features``, ``keep_float_above``, ``dequantize_rows``, ``nbytes``)."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.fallback: nn.Module | None = None
        self.float_above: int | None = None

    def keep_float_above(self, rows: int, fallback: nn.Module) -> None:
        self.fallback, self.float_above = fallback, rows

    def set_batch_invariant(self) -> None:
        """:meth:`QuantLinear.set_batch_invariant` on every part; the float fallback dropped
        (each part's output is per-row invariant, and so is their concatenation)."""
        for part in self.parts:
            part.set_batch_invariant()
        self.fallback = self.float_above = None

    def set_panel_dtype(self, dtype: torch.dtype) -> None:
        for part in self.parts:
            part.set_panel_dtype(dtype)

    def set_q4_kernel(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_kernel(name)

    def set_q8_kernel(self, name: str) -> None:
        for part in self.parts:
            part.set_q8_kernel(name)

    def set_q4_prefill(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_prefill(name)

    def set_q4_batch(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_batch(name)

    def set_q4_layout(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_layout(name)

    def set_q4_tiles(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_tiles(name)

    def set_q8_batch(self, name: str) -> None:
        for part in self.parts:
            part.set_q8_batch(name)

    def set_q8_layout(self, name: str) -> None:
        for part in self.parts:
            part.set_q8_layout(name)

    def set_q8_tiles(self, name: str) -> None:
        for part in self.parts:
            part.set_q8_tiles(name)

    def set_q8_amx_from(self, rows: str) -> None:
        for part in self.parts:
            part.set_q8_amx_from(rows)

    def set_q4_amx(self, name: str) -> None:
        for part in self.parts:
            part.set_q4_amx(name)

    def set_q4_amx_from(self, rows: str) -> None:
        for part in self.parts:
            part.set_q4_amx_from(rows)

    def set_activation(self, name: str) -> bool:
        """:meth:`QuantLinear.set_activation` on every part; whether all took it."""
        return all([part.set_activation(name) for part in self.parts])

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(rows.numel(), self.in_features, dtype=dtype)
        start = 0
        for part in self.parts:
            hit = (rows >= start) & (rows < start + part.out_features)
            out[hit] = part.dequantize_rows(rows[hit] - start, dtype)
            start += part.out_features
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None and x.reshape(-1, self.in_features).shape[0] > self.float_above:
            return self.fallback(x)
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        above = "" if self.fallback is None else f", float above {self.float_above} rows"
        return f"in={self.in_features}, out={self.out_features}{above}"


class QuantEmbedding(nn.Module):
    """Token embedding over a packed table; ``head`` is the same table as a ``QuantLinear``
    (for a tied logits head), and holds the only copy of the data."""

    def __init__(self, packed: Packed) -> None:
        super().__init__()
        self.head = QuantLinear(packed)
        self.num_embeddings, self.embedding_dim = packed.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.head.dequantize_rows(flat).view(*ids.shape, self.embedding_dim)


@dataclass
class QuantisedModules:
    """Replacement modules by attribute path (``layers.3.qkv_proj``, ``lm_head``), and the
    embedding (None when the token table is not packed)."""

    linears: dict[str, QuantLinear | QuantConcat] = field(default_factory=dict)
    embedding: QuantEmbedding | None = None
    # Packed experts of mixture-of-experts layers by path (``layers.N.moe.experts``;
    # engine.quantization.moe). Not probed: swapped in whenever the linears are.
    experts: dict[str, nn.Module] = field(default_factory=dict)

    def modules(self) -> list[QuantLinear | QuantConcat]:
        """The linears and the embedding's head (the packed table, also a tied logits head)."""
        return [*self.linears.values(), *([self.embedding.head] if self.embedding else [])]

    @property
    def nbytes(self) -> int:
        return (sum(m.nbytes for m in self.modules())
                + sum(m.nbytes for m in self.experts.values()))
