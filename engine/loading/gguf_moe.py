"""Mixture-of-experts GGUF files (``qwen3moe``; Mixtral, which llama.cpp writes as ``llama``
with ``llama.expert_count``): their config and their stacked expert tensors.

llama.cpp stores a sparse layer's experts as 3-D tensors ``blk.N.ffn_{gate,up,down}_exps``
(``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]`` row-major) and the router as ``blk.N.ffn_gate_inp``
``[E, H]``. :func:`moe_config` fixes the config transformers' GGUF reader makes of such a file
(Qwen3-MoE's ``moe_intermediate_size`` from ``qwen3moe.expert_feed_forward_length``; a llama
file with experts becomes a ``MixtralConfig``). :func:`expert_plan` replaces the conversion
plan's entries for those tensors by :class:`StackedExperts` under HF's fused names
(``mlp.experts.gate_up_proj`` = gate rows then up rows per expert, ``down_proj``,
``mlp.gate.weight``), dequantised by ``gguf``'s own dequantiser. :func:`expert_packs` gives a
quantised expert tensor's experts as packed weights, one per expert, under HF's per-expert
names, for ``quantization=auto``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.loading.gguf_fields import gguf_field, gguf_reader
from engine.quantization.formats import Packed
from engine.quantization.gguf_blocks import SUPPORTED, from_gguf_blocks

_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight$")
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def moe_config(gguf_path: Path, config):
    """The config of a mixture-of-experts GGUF, fixed as the module docstring says."""

    reader = gguf_reader(gguf_path)
    arch = gguf_field(reader, "general.architecture")
    experts = gguf_field(reader, f"{arch}.expert_count") or 0
    if arch == "qwen3moe":
        inter = gguf_field(reader, f"{arch}.expert_feed_forward_length")
        if inter:
            config.moe_intermediate_size = int(inter)
        return config
    if arch != "llama" or experts <= 0:
        return config
    from transformers import MixtralConfig

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    fields.update(num_local_experts=int(experts),
                  num_experts_per_tok=int(gguf_field(reader, f"{arch}.expert_used_count") or 2))
    return MixtralConfig(**fields)


def gguf_model_type(config) -> str | None:
    """The model type ``gguf``'s tensor-name map knows the config's checkpoints under
    (Mixtral files are ``llama`` files), or None for the config's own."""
    return "llama" if getattr(config, "model_type", None) == "mixtral" else None


@dataclass
class StackedExperts:
    """One HF tensor made of GGUF tensors stacked as HF stores it: the parts are concatenated
    along dimension 1 (gate then up), or a single part (down, router). Quacks like a
    ``GGUFReader`` tensor where the conversion needs it (``name``, ``n_elements``,
    ``tensor_type``, ``shape``, ``parts``: ``engine.loading.packed_policy.is_packable`` counts
    its experts among the packed tensors, whose float copies are not written when too big)."""

    name: str
    parts: tuple

    @property
    def n_elements(self) -> int:
        return sum(int(p.n_elements) for p in self.parts)

    @property
    def tensor_type(self) -> int:
        return int(self.parts[0].tensor_type)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.parts[0].shape[:-1], sum(int(p.shape[-1]) for p in self.parts))

    def float32(self) -> torch.Tensor:
        """The float32 HF tensor (``gguf.dequantize`` of each part, concatenated)."""
        from gguf import dequantize

        arrays = [_hf_shaped(dequantize(p.data, p.tensor_type), p) for p in self.parts]
        out = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-2)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _hf_shaped(values: np.ndarray, tensor) -> np.ndarray:
    """Dequantised values in HF's row-major shape (GGUF lists dimensions innermost first)."""
    return values.reshape(tuple(int(s) for s in reversed(list(tensor.shape))))


def expert_plan(reader, plan: list[tuple], expected: dict) -> list[tuple]:
    """``plan`` (``(tensor, hf_name)`` pairs) without the router and expert tensors, plus one
    :class:`StackedExperts` per HF router / gate_up / down tensor that ``expected`` names."""
    layers: dict[int, dict[str, object]] = {}
    for t in reader.tensors:
        if m := _EXPERTS.match(t.name):
            layers.setdefault(int(m[1]), {})[m[2]] = t
        elif m := _ROUTER.match(t.name):
            layers.setdefault(int(m[1]), {})["router"] = t
    if not layers:
        return plan
    moe_names = {t.name for parts in layers.values() for t in parts.values()}
    out = [(t, hf) for t, hf in plan if t.name not in moe_names]
    for i, parts in sorted(layers.items()):
        prefix = f"model.layers.{i}.mlp"
        wanted = [(f"{prefix}.gate.weight", ("router",)),
                  (f"{prefix}.experts.gate_up_proj", ("gate", "up")),
                  (f"{prefix}.experts.down_proj", ("down",))]
        for hf, keys in wanted:
            if hf in expected and all(k in parts for k in keys):
                out.append((StackedExperts(f"{prefix}:{'+'.join(keys)}",
                                           tuple(parts[k] for k in keys)), hf))
    return out


def expert_packs(tensor) -> dict[str, Packed] | None:
    """A ``GGUFReader`` tensor's experts as packed weights by HF per-expert name; None when it
    is no expert tensor, ``{}`` when its block type has no packed form (it stays float)."""
    from engine.models.moe_model import expert_param_name

    m = _EXPERTS.match(tensor.name)
    if m is None:
        return None
    if int(tensor.tensor_type) not in SUPPORTED or len(tensor.shape) != 3:
        return {}
    k, n, experts = (int(s) for s in tensor.shape)
    packed = from_gguf_blocks(np.asarray(tensor.data), int(tensor.tensor_type), (experts * n, k))
    return {expert_param_name(int(m[1]), e, _HF_PROJ[m[2]]):
            packed.take_rows(torch.arange(e * n, (e + 1) * n)) for e in range(experts)}
