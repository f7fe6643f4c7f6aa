"""One LoRA adapter as read from its files, before it is placed on a device.

A :class:`LoRAAdapter` holds, per decoder layer and per HF projection name (``q_proj`` …
``down_proj``), the pair ``(A [r, in], B [out, r])`` in float32 on the CPU, with rows in HF
order (a GGUF adapter's permuted Q/K rows are already undone), and the scale its delta is
multiplied by: ``y = x W^T + scaling * (x A^T) B^T``. The parsers are ``peft_format`` and
``gguf_format``; ``load.load_adapter`` picks one by the path.

The ``fingerprint`` names the adapter's arithmetic (weights and scale, not its name or path):
it enters the KV cache's block hashes, so a prefix computed under one adapter is shared only
with requests of an adapter of the same fingerprint (the same one, or a byte-equal copy)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# The projections an adapter may target, in HF names.
TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj")
# Which of our (fused) modules each target lands in, and its part there.
FUSED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0)}
# Our modules, with the HF targets that fill their parts in order.
MODULE_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights on the CPU (module docstring). Frozen; its tensors are not copied
    or changed after construction."""

    # The name requests select it by (``model`` in the API).
    name: str
    # Where it was read from (a PEFT directory or a GGUF file).
    path: str
    # The largest rank over its pairs (each pair's own rank is A's row count).
    rank: int
    # The delta's factor: lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA).
    scaling: float
    # (layer index, HF target) -> (A [r, in], B [out, r]), float32, CPU, HF row order.
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # The base model the adapter says it was trained on (informational), if it says.
    base_model: str | None = None
    # sha256 over the weights and the scale (module docstring); computed when left empty.
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRA adapter needs a name")
        if not self.weights:
            raise ValueError(f"LoRA adapter {self.name!r} at {self.path} has no weights")
        for (layer, target), (a, b) in self.weights.items():
            if target not in FUSED:
                raise ValueError(f"LoRA adapter {self.name!r} targets {target!r}; kvserve "
                                 f"serves adapters of {', '.join(TARGETS)}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA adapter {self.name!r}: layer {layer} {target} has "
                                 f"A {tuple(a.shape)} and B {tuple(b.shape)}, which do not "
                                 "pair as [r, in] and [out, r]")
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint(self.weights, self.scaling))

    @property
    def targets(self) -> tuple[str, ...]:
        """The HF targets it has weights for, in ``TARGETS`` order."""
        present = {t for _, t in self.weights}
        return tuple(t for t in TARGETS if t in present)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def fingerprint(weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                scaling: float) -> str:
    """sha256 hex of the scale and every pair's shape and float32 bytes, in a fixed order."""
    h = hashlib.sha256(repr(float(scaling)).encode())
    for key in sorted(weights):
        h.update(repr(key).encode())
        for t in weights[key]:
            t = t.detach().to(torch.float32).contiguous()
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()
