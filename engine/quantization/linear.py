"""Linear layers and embeddings over weights kept packed (``engine.quantization.formats``).

``QuantLinear(packed, bias)`` computes ``y = x @ W.T + b`` for ``W`` in 4-bit, 5-bit or 8-bit
groups (8-bit: scales per 32 or 16, optional mins). Up to ``dense_rows`` rows (decode) the C++
int8 kernels serve (engine/cpu/csrc/quant_gemm_*.cpp: each activation row rounded to int8 per
group of 32, integer dot products, as llama.cpp's); above (prefill), dequantised ``panel_dtype``
panels or, for 4-bit weights, int8 tiles. Which kernel, layout (4-bit blocked, 8-bit
interleaved), ISA (VNNI, AMX from ``q8_amx_from`` / ``q4_amx_from`` rows) and float fallback
(above ``float_above`` rows) serve is the start-up probe's measured choice
(``engine.quantization.kernel_choice``; figures: docs/decisions.md#quantised-linears); batch
kernels add in another float order, so logits may differ in the last bits with the batch size.
Batch-invariant (:meth:`QuantLinear.set_batch_invariant`): one kernel per weight for every row
count, row ``r``'s output bit-identical whatever the rows; faithful activations
(engine/quantization/activation.py) route decode-sized inputs to ``kernels_faithful.gemm``.
``QuantEmbedding`` dequantises only looked-up rows. Float32 CPU only; packed tensors are buffers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
from engine.quantization.kernel_choice import (  # noqa: F401 (re-exported: importers of linear)
    ACTIVATIONS,
    AMX_FROM,
    BATCH_TILE_ROWS,
    DENSE_ROWS,
    KERNELS,
    LANES_ROWS,
    PANEL_DTYPES,
    Q4_AMX,
    Q4_AMX_FROM,
    Q4_BATCH,
    Q4_LAYOUTS,
    Q4_PREFILL,
    Q4_TILES,
    Q8_BATCH,
    Q8_LAYOUTS,
    Q8_TILES,
    KernelChoice,
    amx_available,
    interleaved_available,
    quant_kernels,
    vnni_available,
)

PANEL_ROWS = 4096  # output rows dequantised at a time on the dense path (bounds the temporary)


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
        self.kernels = KernelChoice()  # replaced whole, by set_kernels / choose
        self._gemm = self._decode_gemm()
        self.batch_invariant = False

    def set_batch_invariant(self) -> None:
        """Serve every row count with one kernel whose per-row arithmetic (int8 activation
        scales per row and group, integer group sums, float accumulation in a fixed order) does
        not depend on how many rows share the call: 4-bit weights move to the blocked layout
        (``quant_gemm_q4_blocked``), 8-bit weights keep their decode kernel (or, stored
        interleaved, ``quant_gemm_q8_interleaved``); a float fallback is dropped. Irreversible
        (the prefill panels and per-size routes are not used again)."""
        self.choose(q4_layout="rows" if self.faithful else "blocked")
        self.fallback = self.float_above = None
        self.batch_invariant = True

    @property
    def faithful(self) -> bool:
        """Whether the faithful kernel (``kernels.activation`` bf16 or float32) serves it."""
        return self.kernels.activation != "int8"

    def set_kernels(self, choice: KernelChoice) -> None:
        """Serve this weight as ``choice`` says (``engine.quantization.kernel_choice``).
        ``activation``: ``int8`` (the int8 kernels above), or ``bf16`` / ``float32``: the
        faithful kernel (``engine.cpu.kernels_faithful.gemm``, the weights dequantised in
        registers times bf16 activations on AVX-512 BF16, float32 ones elsewhere) for every
        decode-sized input, every input in batch-invariant mode, the weight back in the rows
        layouts; 5-bit weights and a build without the faithful kernels keep their activation.
        A weight keeps the layout of another format's field (a 4-bit weight's ``q8_layout``
        stays ``rows``). A changed layout converts the weight in place, exactly, one copy of
        the weight at a time (``interleaved`` needs AVX2: ValueError)."""
        old = self.kernels
        if choice.activation != "int8":
            from engine.cpu import kernels_faithful

            if self.is_q5 or kernels_faithful.load() is None:
                choice = replace(choice, activation=old.activation)
        if choice.activation != "int8":
            choice = replace(choice, q4_layout="rows", q8_layout="rows")
        if not self.is_q4:
            choice = replace(choice, q4_layout=old.q4_layout)
        if not self.is_q8:
            choice = replace(choice, q8_layout=old.q8_layout)
        if self.d.dtype == torch.float16 and old.activation != "int8":
            # the faithful kernels' float16 rows scales: float32 again for any other kernel
            self.d = self.d.float()
            self.m = None if self.m is None else self.m.float()
        if choice.q8_layout != old.q8_layout:
            if choice.q8_layout == "interleaved":
                if not interleaved_available():
                    raise ValueError("the interleaved 8-bit kernel is not built on this CPU (it "
                                     "needs AVX2)")
                self.qs, self.d, self.m = to_interleaved(self.qs, self.d, self.m)
            else:
                self.qs, self.d, self.m = from_interleaved(self.qs, self.d, self.m,
                                                           self.out_features)
        if choice.q4_layout != old.q4_layout:
            if choice.q4_layout == "blocked":
                self.qs, self.d, self.m = to_blocked(self.qs, self.d, self.m)
            else:
                self.qs, self.d, self.m = from_blocked(self.qs, self.d, self.m, self.out_features)
        if choice.activation != "int8":  # a GGUF's scales at their size: fewer bytes a step
            from engine.cpu.kernels_faithful import compact_scales

            self.d, self.m = compact_scales(self.d, self.m)
        self.kernels = choice
        self._gemm = self._decode_gemm()

    def choose(self, **changes) -> None:
        """:meth:`set_kernels` with these fields of :attr:`kernels` changed."""
        self.set_kernels(replace(self.kernels, **changes))

    def _decode_gemm(self):
        """The decode kernel of this weight's format and ``q4_kernel`` / ``q8_kernel``."""
        k = self._kernels
        if self.is_q5:
            return k.quant_gemm_q5
        if self.is_q4:
            return k.quant_gemm_q4_vnni if self.kernels.q4_kernel == "vnni" else k.quant_gemm_q4
        return k.quant_gemm_q8_vnni if self.kernels.q8_kernel == "vnni" else k.quant_gemm_q8

    @property
    def is_q8(self) -> bool:
        return not self.is_q4 and not self.is_q5

    @property
    def lanes_from(self) -> int | None:
        """The row count from which decode-sized inputs of an 8-bit weight run
        ``quant_gemm_q8_batch`` (None: never)."""
        return LANES_ROWS if self.is_q8 and self.kernels.q8_batch == "lanes" \
            and not self.batch_invariant and not self.interleaved else None

    @property
    def interleaved(self) -> bool:
        """Whether the weight is stored interleaved (``kernels.q8_layout``)."""
        return self.kernels.q8_layout == "interleaved"

    @property
    def amx_from(self) -> int | None:
        """The row count from which this weight runs on AMX tiles (None: never): an
        interleaved 8-bit weight's ``q8_amx_from`` (``q8_tiles == "amx"``), a blocked 4-bit
        weight's ``q4_amx_from`` (``q4_amx == "on"``)."""
        if self.interleaved and self.kernels.q8_tiles == "amx":
            return int(self.kernels.q8_amx_from)
        if self.is_q4 and self.blocked and self.kernels.q4_amx == "on":
            return int(self.kernels.q4_amx_from)
        return None

    def _on_amx(self, rows: int) -> bool:
        return self.amx_from is not None and rows >= self.amx_from

    @property
    def blocked(self) -> bool:
        """Whether the weight is stored blocked (``kernels.q4_layout``)."""
        return self.kernels.q4_layout == "blocked"

    @property
    def tiles_from(self) -> int | None:
        """The row count from which decode-sized inputs run the tiles (None: never; a blocked
        weight has its own kernel for every row count)."""
        return BATCH_TILE_ROWS if self.is_q4 and self.kernels.q4_batch == "tiles" and not self.blocked \
            else None

    def keep_float_above(self, rows: int, fallback: nn.Module) -> None:
        """Send inputs of more than ``rows`` rows to ``fallback`` (same weights, float)."""
        self.fallback, self.float_above = fallback, rows

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``W[rows]`` as float32 (or bfloat16)."""
        bf16 = dtype == torch.bfloat16
        if self.interleaved:
            qs, d, m = gather_rows(self.qs, self.d, self.m, rows.reshape(-1))
            return self._kernels.quant_dequant_q8(qs, d, m, torch.arange(rows.numel()), bf16)
        if self.blocked:
            return self._kernels.quant_dequant_q4_blocked(self.qs, self.d, self.m, rows, bf16)
        if self.d.dtype == torch.float16:  # the faithful kernels' rows scales (set_kernels)
            flat = rows.reshape(-1)
            qs, d = self.qs.index_select(0, flat), self.d.index_select(0, flat).float()
            m = None if self.m is None else self.m.index_select(0, flat).float()
            dequant = self._kernels.quant_dequant_q4 if self.is_q4 else \
                self._kernels.quant_dequant_q8
            return dequant(qs, d, m, torch.arange(flat.numel()).view(rows.shape), bf16)
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

        return kernels_faithful.gemm(x2, qs, d, m, bf16=self.kernels.activation == "bf16")

    def _on_lanes(self, rows: int) -> bool:
        """Whether ``rows`` rows run ``quant_gemm_q8_batch`` (8-bit weights only)."""
        return self.lanes_from is not None and self.lanes_from <= rows <= self.dense_rows

    def _on_tiles(self, rows: int) -> bool:
        """Whether ``rows`` rows run the int8 tiles (4-bit weights only): every decode size of
        a blocked weight, a decode batch from ``tiles_from`` rows, or a prefill with
        ``q4_prefill == "int8"``."""
        if rows <= self.dense_rows:
            return self.blocked or (self.tiles_from is not None and rows >= self.tiles_from)
        return self.is_q4 and self.kernels.q4_prefill == "int8" and not self.faithful

    def tiles(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, in] @ W.T`` (float32, no bias) on the 4-bit int8 tiles over this weight's
        layout (blocked, or repacked per call), on the instructions of ``q4_tiles`` (a blocked
        weight's inputs from :attr:`amx_from` rows on AMX tiles)."""
        vnni = self.kernels.q4_tiles == "vnni"
        if self.blocked:
            return self._kernels.quant_gemm_q4_blocked(x2, self.qs, self.d, self.m,
                                                       self.out_features, vnni,
                                                       self._on_amx(x2.shape[0]))
        return self._kernels.quant_gemm_q4_tiled(x2, self.qs, self.d, self.m, vnni)

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        dt = self.kernels.panel_dtype
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

    def set_kernels(self, choice: KernelChoice) -> None:
        """:meth:`QuantLinear.set_kernels` on every part: the same value for each."""
        for part in self.parts:
            part.set_kernels(choice)

    def choose(self, **changes) -> None:
        """:meth:`QuantLinear.choose` on every part (each keeps its other choices)."""
        for part in self.parts:
            part.choose(**changes)

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
    # engine.weight_prep.moe). Not probed: swapped in whenever the linears are.
    experts: dict[str, nn.Module] = field(default_factory=dict)

    def modules(self) -> list[QuantLinear | QuantConcat]:
        """The linears and the embedding's head (the packed table, also a tied logits head)."""
        return [*self.linears.values(), *([self.embedding.head] if self.embedding else [])]

    @property
    def nbytes(self) -> int:
        return (sum(m.nbytes for m in self.modules())
                + sum(m.nbytes for m in self.experts.values()))
