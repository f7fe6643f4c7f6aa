"""The model's projections with the adapters' delta added: ``attach_lora`` wraps them."""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.adapter import MODULE_PARTS
from engine.lora.weights import LoRAWeights, ModuleShape


class LoRALinear(nn.Module):
    """``base(x)`` plus the LoRA delta of the rows the step runs under an adapter
    (``LoRAWeights.apply``); exactly ``base(x)`` when no row has one."""

    def __init__(self, base: nn.Module, weights: LoRAWeights, layer: int, module: str) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.module = module
        # Not a submodule: one LoRAWeights serves every layer.
        object.__setattr__(self, "weights", weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.weights.batch is not None:
            self.weights.apply(self.layer, self.module, x, out)
        return out


def module_shapes(model: nn.Module) -> dict[tuple[int, str], ModuleShape]:
    """Every adapter-targetable projection of ``model``'s layers with its fused parts' sizes
    (a mixture-of-experts layer has no dense MLP: attention only)."""
    shapes: dict[tuple[int, str], ModuleShape] = {}
    for i, layer in enumerate(model.layers):
        h = model.arch.hidden_size
        parts = {"qkv_proj": (h, (layer.q_size, layer.kv_size, layer.kv_size)),
                 "o_proj": (layer.q_size, (h,))}
        if isinstance(getattr(layer, "gate_up_proj", None), nn.Module):
            inter = layer.intermediate_size
            parts["gate_up_proj"] = (h, (inter, inter))
            parts["down_proj"] = (inter, (h,))
        for module, (fan_in, sizes) in parts.items():
            assert len(sizes) == len(MODULE_PARTS[module])
            shapes[(i, module)] = ModuleShape(fan_in, sizes)
    return shapes


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, device: torch.device,
                dtype: torch.dtype) -> LoRAWeights:
    """Wrap every targetable projection of ``model`` in a :class:`LoRALinear` over one new
    :class:`LoRAWeights`, which it returns and also sets as ``model.lora``. Call once the
    projections are final (packed, batch-invariant), before the C++ decode stack is built
    (it unwraps them and adds the delta itself)."""
    weights = LoRAWeights(module_shapes(model), max_loras, max_rank, device, dtype)
    for (i, module) in weights.shapes:
        layer = model.layers[i]
        setattr(layer, module, LoRALinear(getattr(layer, module), weights, i, module))
    model.lora = weights
    return weights
