"""Qwen3-MoE and Mixtral: the Llama-family decoder (engine.models.llama) whose sparse layers
replace the MLP by a mixture-of-experts block (engine.models.moe).

Weights load from every HF naming these checkpoints use: transformers >= 5's stacked
``mlp.gate.weight`` ``[E, H]``, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]``; Qwen3-MoE hub checkpoints'
``mlp.experts.E.{gate,up,down}_proj.weight``; Mixtral's ``block_sparse_moe.gate.weight`` and
``block_sparse_moe.experts.E.{w1,w3,w2}.weight`` (gate, up, down). Per-expert tensors are copied
into the stacked parameters; a stacked parameter counts as loaded when given whole or when all
its per-expert parts were. Qwen3-MoE's dense layers (``mlp_only_layers``) keep the plain fused
MLP. Under tensor parallelism each rank holds every expert's slice of the intermediate features
and ``tp`` is passed on to the layers, whose all-reduce after the MLP sums the partial outputs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.arch import ModelArch
from engine.models.layer_ops import TorchLayerOps
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.moe import MoeBlock

if TYPE_CHECKING:
    from engine.models.tp_group import TPGroup

_ROUTER = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_STACKED = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# per-expert projection -> (stacked parameter, part: 0 gate rows, 1 up rows, None whole)
_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
          "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def stacked_names(names: Iterable[str]) -> set[str]:
    """The stacked HF names (``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``) that
    per-expert ``names`` cover whole: a layer's gate_up when both its gate and up projections
    are among them (for expert 0: a GGUF tensor's experts are packed all or none), its down
    when its down is. A checkpoint's stacked float copy of such a tensor need not be read."""
    seen: dict[tuple[int, str], set[int | None]] = {}
    for name in names:
        if (m := _PER_EXPERT.match(name)) and m[2] == "0":
            param, part = _PARTS[m[3]]
            seen.setdefault((int(m[1]), param), set()).add(part)
    return {f"model.layers.{layer}.mlp.experts.{param}" for (layer, param), parts in seen.items()
            if parts == ({0, 1} if param == "gate_up_proj" else {None})}


def expert_param_name(layer: int, expert: int, proj: str) -> str:
    """HF's per-expert name (Qwen3-MoE spelling) for ``proj`` in gate_proj/up_proj/down_proj:
    the names under which packed experts are keyed (engine.loading.gguf_moe)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a :class:`MoeBlock` (``moe``) when the spec marks the layer
    sparse; otherwise exactly the Llama layer."""

    def __init__(self, arch: ModelArch, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__(arch, layer_idx, tp)
        self.moe: MoeBlock | None = None
        if arch.moe is not None and arch.moe.sparse_layers[layer_idx]:
            del self.gate_up_proj, self.down_proj
            self.moe = MoeBlock(arch.moe, arch.hidden_size)

    def feed_forward(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        if self.moe is None:
            return super().feed_forward(x, ops)
        return self.moe(x, ops)


class MoeForCausalLM(LlamaForCausalLM):
    """``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM``: see the module docstring."""

    def __init__(self, arch: ModelArch, max_positions: int | None = None,
                 tp: TPGroup | None = None) -> None:
        if arch.moe is None:
            raise ValueError(f"{arch.model_type} has no mixture-of-experts layers")
        super().__init__(arch, max_positions, tp)
        self.layers = nn.ModuleList(MoeDecoderLayer(arch, i, tp) for i in range(arch.num_layers))

    def moe_blocks(self) -> dict[int, MoeBlock]:
        """The sparse layers' blocks by layer index."""
        return {i: layer.moe for i, layer in enumerate(self.layers) if layer.moe is not None}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Iterable[str] = ()) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, with the expert names of the module
        docstring; ``skip`` may hold per-expert names (experts served packed)."""
        skip = list(skip)
        loaded: set[tuple[int, str, int | None, int | None]] = set()  # layer, param, expert, part
        for name in skip:
            self._note(name, loaded)
        blocks = self.moe_blocks()

        def dense_only(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
            for name, tensor in stream:
                if not self._load_moe(name, tensor, blocks, loaded):
                    yield name, tensor

        moe_names = {f"layers.{i}.moe.{p}" for i in blocks
                     for p in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")}
        super().load_weights(dense_only(weights), skip=[*skip, *moe_names])
        missing = [f"layers.{i}.{p}" for i in blocks for p in ("router", "gate_up_proj",
                                                                "down_proj")
                   if not self._complete(i, p, loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks expert weights: {', '.join(missing[:5])}"
                             + (" …" if len(missing) > 5 else ""))

    @classmethod
    def _target(cls, name: str) -> tuple[str, int | None]:
        if name.startswith("layers.") and ".moe." in name:  # our own names (from skip lists)
            return name, None
        return super()._target(name)

    def _note(self, name: str, loaded: set) -> bool:
        """Record a skipped (served elsewhere) expert tensor; whether ``name`` was one."""
        if m := _PER_EXPERT.match(name):
            param, part = _PARTS[m[3]]
            loaded.add((int(m[1]), param, int(m[2]), part))
            return True
        if m := _STACKED.match(name):
            loaded.add((int(m[1]), m[2], None, None))
            return True
        return False

    def _load_moe(self, name: str, tensor: torch.Tensor, blocks: dict[int, MoeBlock],
                  loaded: set) -> bool:
        """Copy ``name`` in if it is a router or expert tensor; whether it was one."""
        for pattern in (_ROUTER, _STACKED, _PER_EXPERT):
            m = pattern.match(name)
            if m is None:
                continue
            layer = int(m[1])
            if layer not in blocks:
                raise ValueError(f"checkpoint has expert weights {name!r} for dense layer "
                                 f"{layer}")
            block = blocks[layer]
            if pattern is _ROUTER:
                self._copy(block.gate.weight, tensor, name)
                loaded.add((layer, "router", None, None))
            elif pattern is _STACKED:
                self._copy(getattr(block.experts, m[2]), tensor, name)
                loaded.add((layer, m[2], None, None))
            else:
                expert, (param, part) = int(m[2]), _PARTS[m[3]]
                dst = getattr(block.experts, param).data[expert]
                if part is not None:
                    inter = block.experts.intermediate
                    dst = dst.narrow(0, part * inter, inter)
                self._copy(dst, tensor, name)
                loaded.add((layer, param, expert, part))
            return True
        return False

    def _complete(self, layer: int, param: str, loaded: set) -> bool:
        if (layer, param, None, None) in loaded:
            return True
        if param == "router":
            return False
        parts = (0, 1) if param == "gate_up_proj" else (None,)
        experts = self.arch.moe.num_experts
        return all((layer, param, e, p) in loaded for e in range(experts) for p in parts)
