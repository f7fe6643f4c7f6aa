"""The adapters' weights on the device, slot by slot, and the batched LoRA delta.

A :class:`LoRAWeights` knows the model's projections (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` of each layer, with the output sizes of their fused parts)
and holds ``max_loras`` slots. ``place(slot, adapter)`` writes an adapter's pairs into a slot
with its scale folded into B, in the model's dtype; ``apply`` adds the delta of every row
that runs under an adapter to a projection's output, for the step's :class:`LoRABatch`
(``batch``, set by the runner before each forward pass, None when no row has an adapter).

How ``apply`` computes (``kind``):

* ``"cpu-kernel"`` (a CPU, float32, the C++ kernels built): one ``lora_apply_`` call per
  projection serves every row, each reading its own slot's weights and only its adapter's
  rank (``ranks``); a row's arithmetic does not depend on the other rows (batch invariance),
  and the C++ decode stack calls the same kernel (``stack_specs``).
* ``"triton"`` (a GPU): the one-launch kernels of ``kvserve_kernels.lora`` over the same
  zero-padded stacked layout.
* ``"matmul"`` (elsewhere): per slot present, one shrink and one expand matmul per part over
  that slot's rows (a row's rounding may then follow the row count).

The stacked layout: per (layer, module) ``A [slots, parts * max_rank, in]`` and per part
``B [slots, out_p, max_rank]`` (``cpu-kernel``: transposed, ``[slots, max_rank, out_p]``, so
the expand runs along the outputs), zero-padded, and ``ranks [slots, parts]`` (int32; 0 where
the adapter lacks the part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.adapter import FUSED, LoRAAdapter
from engine.lora.batch import LoRABatch


@dataclass(frozen=True)
class ModuleShape:
    """One projection of one layer: its input width and its fused parts' output widths."""

    in_features: int
    part_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    def part_offset(self, part: int) -> int:
        return sum(self.part_sizes[:part])


@dataclass(frozen=True)
class _Compact:
    """One slot's pairs for one (layer, module) on the matmul path: A stacked along the rank,
    and per present part (output offset, output size, column range in the shrunk rows, B)."""

    a: torch.Tensor  # [sum r, in]
    parts: tuple[tuple[int, int, int, int, torch.Tensor], ...]


def _cpu_kernels(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu" or dtype != torch.float32:
        return None
    from engine.cpu.kernels import load

    module = load()
    return module if module is not None and hasattr(module, "lora_apply_") else None


class LoRAWeights:
    """Device slots of adapter weights (module docstring)."""

    def __init__(self, shapes: dict[tuple[int, str], ModuleShape], max_loras: int,
                 max_rank: int, device: torch.device, dtype: torch.dtype,
                 kind: str | None = None) -> None:
        """``kind``: the path (module docstring), chosen from the device and dtype when None;
        ``"matmul"`` may be asked for anywhere (A/B runs and tests)."""
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.batch: LoRABatch | None = None
        self._kernels = _cpu_kernels(device, dtype)
        auto = ("triton" if device.type == "cuda" else
                "cpu-kernel" if self._kernels is not None else "matmul")
        if kind not in (None, "matmul", auto):
            raise ValueError(f"LoRA kind {kind!r} does not run on {device} {dtype}")
        self.kind = kind or auto
        self._b_transposed = self.kind == "cpu-kernel"
        self._slots: list[dict[tuple[int, str], _Compact]] = [{} for _ in range(max_loras)]
        self.stacked_a: dict[tuple[int, str], torch.Tensor] = {}
        self.stacked_b: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        self._offsets: dict[tuple[int, str], list[int]] = {}
        if self.stacked:
            for key, shape in shapes.items():
                parts = len(shape.part_sizes)
                self.stacked_a[key] = torch.zeros(max_loras, parts * max_rank,
                                                  shape.in_features, device=device, dtype=dtype)
                self.stacked_b[key] = tuple(
                    torch.zeros(*((max_loras, max_rank, size) if self._b_transposed else
                                  (max_loras, size, max_rank)), device=device, dtype=dtype)
                    for size in shape.part_sizes)
                self.ranks[key] = torch.zeros(max_loras, parts, dtype=torch.int32)
                self._offsets[key] = [shape.part_offset(p) for p in range(parts)]

    @property
    def stacked(self) -> bool:
        """The stacked layout (module docstring) serves this device."""
        return self.kind != "matmul"

    def check(self, adapter: LoRAAdapter) -> None:
        """ValueError naming the first pair that does not fit this model (layer, shape,
        a projection the layer lacks, rank above ``max_rank``)."""
        for (layer, target), (a, b) in adapter.weights.items():
            module, part = FUSED[target]
            shape = self.shapes.get((layer, module))
            if shape is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} has weights for layer {layer} "
                                 f"{target}, which this model does not have")
            want_in, want_out = shape.in_features, shape.part_sizes[part]
            if a.shape[1] != want_in or b.shape[0] != want_out:
                raise ValueError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {target} maps "
                    f"{a.shape[1]} -> {b.shape[0]} features, the model's {want_in} -> "
                    f"{want_out}: it was trained for another base model")
            if a.shape[0] > self.max_rank:
                raise ValueError(f"LoRA adapter {adapter.name!r} has rank {a.shape[0]}, above "
                                 f"--max-lora-rank {self.max_rank}")

    @torch.no_grad()
    def place(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write ``adapter`` into ``slot`` (``None``: empty it). Call between steps only."""
        if self.stacked:
            self._place_stacked(slot, adapter)
        else:
            self._slots[slot] = {} if adapter is None else self._compact(adapter)

    def _compact(self, adapter: LoRAAdapter) -> dict[tuple[int, str], _Compact]:
        by_module: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), (a, b) in adapter.weights.items():
            module, part = FUSED[target]
            by_module.setdefault((layer, module), []).append((part, a, b))
        compact = {}
        for key, pairs in by_module.items():
            shape = self.shapes[key]
            pairs.sort(key=lambda p: p[0])
            a_rows, parts, col = [], [], 0
            for part, a, b in pairs:
                r = a.shape[0]
                a_rows.append(a)
                b_dev = (b * adapter.scaling).to(self.device, self.dtype).contiguous()
                parts.append((shape.part_offset(part), shape.part_sizes[part], col, col + r,
                              b_dev))
                col += r
            compact[key] = _Compact(torch.cat(a_rows).to(self.device, self.dtype).contiguous(),
                                    tuple(parts))
        return compact

    def _place_stacked(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for key in self.shapes:
            self.stacked_a[key][slot].zero_()
            for b in self.stacked_b[key]:
                b[slot].zero_()
            self.ranks[key][slot].zero_()
        if adapter is None:
            return
        r_max = self.max_rank
        for (layer, target), (a, b) in adapter.weights.items():
            module, part = FUSED[target]
            key = (layer, module)
            r = a.shape[0]
            self.stacked_a[key][slot, part * r_max:part * r_max + r].copy_(a)
            b = b * adapter.scaling
            if self._b_transposed:
                self.stacked_b[key][part][slot, :r].copy_(b.t())
            else:
                self.stacked_b[key][part][slot, :, :r].copy_(b)
            self.ranks[key][slot, part] = r

    def stack_specs(self, layer: int, module: str) -> tuple | None:
        """``(A, Bs, ranks, offsets)`` of one projection for the C++ decode stack (the
        ``cpu-kernel`` kind), or None."""
        key = (layer, module)
        if self.kind != "cpu-kernel" or key not in self.stacked_a:
            return None
        return self.stacked_a[key], list(self.stacked_b[key]), self.ranks[key], \
            self._offsets[key]

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add to ``out`` (``[T, out_features]``, the base projection of ``x``) the delta of
        every row that runs under an adapter in ``self.batch``."""
        batch = self.batch
        if batch is None:
            return
        key = (layer, module)
        if self.kind == "cpu-kernel":
            self._kernels.lora_apply_(out, x if x.stride(-1) == 1 else x.contiguous(),
                                      batch.row_slots, self.stacked_a[key],
                                      list(self.stacked_b[key]), self.ranks[key],
                                      self._offsets[key])
        elif self.kind == "triton":
            self._apply_triton(key, x, out, batch.row_slots)
        else:
            self._apply_matmul(key, x, out, batch)

    def _apply_matmul(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor,
                      batch: LoRABatch) -> None:
        for slot, rows in batch.groups:
            entry = self._slots[slot].get(key)
            if entry is None:
                continue
            shrunk = x[rows] @ entry.a.t()
            for off, size, c0, c1, b in entry.parts:
                delta = shrunk[:, c0:c1] @ b.t()
                if size == out.shape[1]:
                    if isinstance(rows, slice):
                        out[rows] += delta
                    else:
                        out.index_add_(0, rows, delta)
                else:  # rows are distinct: a gathered read-add-write is exact
                    out[rows, off:off + size] += delta

    def _apply_triton(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor,
                      row_slots: torch.Tensor) -> None:
        from kvserve_kernels.lora import lora_expand, lora_shrink

        shrunk = lora_shrink(x, self.stacked_a[key], row_slots)
        r = self.max_rank
        for part, (b, off) in enumerate(zip(self.stacked_b[key], self._offsets[key])):
            lora_expand(shrunk, b, row_slots, out, y_offset=part * r, out_offset=off)
