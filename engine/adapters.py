"""The engine's LoRA adapters: the registry the core consults, the slots the scheduler pins.

``Adapters`` is built by ``engine.assembly`` when ``config.enable_lora`` is set, over the
runner's ``LoRAWeights`` (``engine.lora.weights``). It lives on the engine thread except
``names`` (an immutable snapshot, replaced whole), which other threads may read to check a
request before it is queued.

A request's adapter is resolved once, when it is added: ``SamplingParams.lora_name`` names a
loaded adapter (ValueError otherwise), the request keeps that adapter's ``lora_id`` for its
whole life (a later unload or reload of the name does not change it), and the adapter's
fingerprint joins the request's KV cache keys: its prefix blocks are shared only with
requests under the same weights (engine/kv_cache/hashing.py), in every tier.
"""

from __future__ import annotations

import logging
import time

from engine.lora.adapter import LoRAAdapter
from engine.lora.load import load_adapter
from engine.lora.slots import LoRASlots
from engine.lora.weights import LoRAWeights
from engine.request import Request

logger = logging.getLogger("kvserve.engine")


class Adapters:
    """Loaded LoRA adapters and their device slots (module docstring)."""

    def __init__(self, weights: LoRAWeights, max_loras: int, max_rank: int,
                 num_heads: int, num_kv_heads: int) -> None:
        self.weights = weights
        self.slots = LoRASlots(max_loras, max_rank, weights.place)
        self._heads = (num_heads, num_kv_heads)
        self.names: frozenset[str] = frozenset()
        # name -> (path, lora_id): what /v1/models lists; replaced whole like ``names``.
        self.listing: tuple[tuple[str, str, int], ...] = ()
        # fingerprint -> (lora_id, name) of every adapter ever added: the KV events' fields
        self._by_fingerprint: dict[str, tuple[int, str]] = {}

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's files (any thread: touches no engine state);
        ValueError with the reason when they cannot be served by this model."""
        started = time.perf_counter()
        adapter = load_adapter(name, path, num_heads=self._heads[0],
                               num_kv_heads=self._heads[1])
        self.weights.check(adapter)  # shapes, and each pair's rank against --max-lora-rank
        logger.info("LoRA adapter %r read from %s in %.2f s: rank %d, %s, %.1f MiB", name,
                    path, time.perf_counter() - started, adapter.rank,
                    "+".join(adapter.targets), adapter.num_bytes / 2**20)
        return adapter

    def add(self, adapter: LoRAAdapter) -> int:
        """Register an adapter read by ``read`` (engine thread); returns its lora_id."""
        lora_id = self.slots.add(adapter)
        self._by_fingerprint[adapter.fingerprint] = (lora_id, adapter.name)
        self._publish()
        return lora_id

    def remove(self, name: str) -> None:
        """Unload ``name`` (engine thread); KeyError if it is not loaded. Running requests of
        it finish on its weights."""
        self.slots.remove(name)
        self._publish()

    def _publish(self) -> None:
        loaded = self.slots.loaded()
        self.listing = tuple((a.name, a.path, i) for i, a in loaded)
        self.names = frozenset(a.name for _, a in loaded)

    def lora_of(self, keys: tuple) -> tuple[int, str] | None:
        """(lora_id, name) of the adapter a block's cache ``keys`` name (None: the base):
        what the KV events publish as ``lora_id`` / ``lora_name``."""
        for key in keys:
            if isinstance(key, tuple) and len(key) == 2 and key[0] == "lora":
                return self._by_fingerprint.get(key[1])
        return None

    def check(self, name: str) -> None:
        """ValueError when ``name`` is not a loaded adapter (any thread)."""
        if name not in self.names:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")

    def resolve(self, req: Request) -> None:
        """Fix ``req``'s adapter (engine thread, in ``add_request``): its lora_id and KV keys."""
        name = req.params.lora_name
        if name is None:
            return
        lora_id = self.slots.id_of(name)
        if lora_id is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        req.lora_id = lora_id
        req.cache_extra_keys = (*req.cache_extra_keys,
                                ("lora", self.slots.adapter(lora_id).fingerprint))
