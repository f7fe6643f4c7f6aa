"""KV cache groups: how a model's layers share the paged pool when their attention types differ.

A model whose layers all attend the same way (every layer full, or every layer through the same
sliding window) has ONE group: each layer owns a ``[num_blocks, block_size, ...]`` tensor and a
sequence has one block table, as always. A hybrid model (Gemma 3: five sliding-window layers to
one global layer; Qwen2/Mistral configs with ``layer_types``) is split into groups of the same
attention type and the same number of layers ``group_size`` (the gcd of the per-type layer
counts): Gemma-3-270M's 3 full + 15 window layers give one full group and five window groups of
three layers each. The pool then holds ``group_size`` tensors ("slots"); layer ``i`` stores into
slot ``layer_slot[i]`` and reads through the block table of its group ``layer_group[i]``, so one
physical block of the pool is one group's page: the K/V of ``block_size`` tokens in
``group_size`` layers. Every group has its own block table per sequence over the shared pool: a
full group keeps the whole history, a window group of window ``W`` holds at most
``ceil(W / block_size) + 1`` blocks and gives back the ones that slid out (the idea of vLLM's
hybrid KV cache manager and its ``KVCacheGroupSpec``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (model order) and their window (None: full attention)."""

    layers: tuple[int, ...]
    window: int | None

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """The most blocks one sequence of ``num_tokens`` holds in this group at once."""
        blocks = -(-num_tokens // block_size)
        if self.window is None:
            return blocks
        return min(blocks, -(-self.window // block_size) + 1)


@dataclass(frozen=True)
class KVGroupLayout:
    """The model's groups, and for each layer its group and its slot in the pool."""

    groups: tuple[KVCacheGroupSpec, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV group layout needs at least one group")
        sizes = {len(g.layers) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV groups must have equal layer counts, got {sorted(sizes)}")
        for g in self.groups:
            if g.window is not None and g.window < 1:
                raise ValueError(f"a sliding window must be >= 1 token, got {g.window}")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def group_size(self) -> int:
        """Layers per group = tensors (slots) in the pool."""
        return len(self.groups[0].layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Pool blocks one sequence of ``num_tokens`` tokens holds at most, all groups."""
        return sum(g.max_blocks(num_tokens, block_size) for g in self.groups)

    def max_seq_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence a pool of ``num_blocks`` blocks can hold alone (0 if none)."""
        full = sum(g.window is None for g in self.groups)
        windowed = sum(g.max_blocks(1 << 62, block_size) for g in self.groups
                       if g.window is not None)
        left = num_blocks - windowed
        if left < 0:
            return 0
        return (left // full) * block_size if full else 1 << 62

    def max_concurrency(self, num_blocks: int, block_size: int, num_tokens: int) -> float:
        """How many sequences of ``num_tokens`` tokens the pool holds at once."""
        return num_blocks / max(1, self.blocks_for(num_tokens, block_size))

    def bytes_per_token(self, layer_bytes_per_token: int) -> tuple[int, ...]:
        """Per group: the K+V bytes one token takes in that group's layers (given one layer's)."""
        return tuple(len(g.layers) * layer_bytes_per_token for g in self.groups)


def plan_kv_groups(sliding_windows: tuple[int | None, ...]) -> KVGroupLayout:
    """Group layers by attention type (their window, None = full), ``gcd`` layers a group.

    One attention type (or no layers): one group of every layer, slot ``i`` for layer ``i`` --
    exactly the classic layout. Groups are ordered by the first layer of each type, then by
    layer; within a type, layers are dealt out in model order.
    """
    n = len(sliding_windows)
    types: dict[int | None, list[int]] = {}
    for i, w in enumerate(sliding_windows):
        types.setdefault(w, []).append(i)
    if len(types) <= 1:
        window = sliding_windows[0] if n else None
        return KVGroupLayout((KVCacheGroupSpec(tuple(range(n)), window),),
                             (0,) * n, tuple(range(n)))
    size = math.gcd(*(len(v) for v in types.values()))
    groups: list[KVCacheGroupSpec] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for window, layers in types.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(KVCacheGroupSpec(members, window))
    return KVGroupLayout(tuple(groups), tuple(layer_group), tuple(layer_slot))


def describe_kv_groups(layout: KVGroupLayout, num_blocks: int, block_size: int,
                       layer_bytes_per_token: int, max_model_len: int) -> str:
    """One line for the start-up log: the groups, each group's bytes per token, and the
    concurrency at ``max_model_len`` with and without per-group tables."""
    per_group = layout.bytes_per_token(layer_bytes_per_token)
    kinds = ", ".join(f"g{i}: {'full' if g.window is None else f'window {g.window}'} "
                      f"{per_group[i]} B/token" for i, g in enumerate(layout.groups))
    held = layout.blocks_for(max_model_len, block_size)
    flat = layout.num_groups * -(-max_model_len // block_size)  # every group keeping it all
    return (f"hybrid KV cache: {layout.num_groups} groups of {layout.group_size} layers over "
            f"one pool of {num_blocks} blocks x {block_size} tokens ({kinds}); a "
            f"{max_model_len}-token sequence holds {held} blocks ({flat} without): max "
            f"concurrency at max_model_len {num_blocks / held:.2f}x "
            f"({num_blocks / flat:.2f}x without)")
