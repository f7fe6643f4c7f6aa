"""What the scheduler builds its KV manager from: the runner's pool geometry as plain numbers.

The engine core allocates the device (and host) pools through the runner and hands the
scheduler a :class:`KVPool`; the scheduler then builds, and alone owns, the KV manager
(``KVCacheManager``, or ``HybridKVCacheManager`` when the layout has more than one group) and
the streaming-eviction policy (``--kv-eviction``) with :func:`build_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.engine import EngineConfig
from engine.config.kv_eviction import KVEvictionSpec
from engine.kv_cache.groups import KVGroupLayout
from engine.kv_cache.host.blocks import SwapCostModel
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.streaming import StreamingEviction


@dataclass(frozen=True)
class KVPool:
    """The pools the runner allocated and the model's attention windows.

    ``num_blocks``: device blocks of ``config.block_size`` tokens (a hybrid layout's pages
    hold one group's layers). ``num_host_blocks``: the host tier (0: none); ``swap_cost``
    prices swapping against recomputing (needed with a host tier). ``windows``: each layer's
    sliding window (None: the whole context). ``layout``: the KV groups; a hybrid one
    (``is_hybrid``) gets per-group block tables. ``max_model_len``: checks the eviction
    setting."""

    num_blocks: int
    max_model_len: int
    num_host_blocks: int = 0
    swap_cost: SwapCostModel | None = None
    windows: tuple[int | None, ...] = ()
    layout: KVGroupLayout | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block; got {self.num_blocks}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks cannot be negative; got {self.num_host_blocks}")

    @property
    def sliding_window(self) -> int | None:
        """The window every layer attends through, if all have one (blocks wholly behind it
        are given back as a sequence grows); None otherwise."""
        w = self.windows
        return min(w) if w and None not in w else None

    @property
    def is_hybrid(self) -> bool:
        return self.layout is not None and self.layout.is_hybrid


@dataclass(frozen=True)
class KVSetup:
    """What :func:`build_kv` made: the manager, and the eviction policy with its parsed
    setting (both None when ``kv_eviction`` is off)."""

    kv: KVCacheManager | HybridKVCacheManager
    stream: StreamingEviction | None
    eviction: KVEvictionSpec | None


def eviction_spec(config: EngineConfig, pool: KVPool) -> KVEvictionSpec | None:
    """``config.kv_eviction`` parsed and checked against the model (None when off)."""
    spec = config.eviction_spec()
    if spec is None:
        return None
    if any(w is not None for w in pool.windows):
        raise ValueError("kv_eviction is for models whose layers see the whole context; this "
                         "one has sliding-window layers, which already bound their KV")
    spec.validate(config.block_size, pool.max_model_len)
    return spec


def build_kv(config: EngineConfig, pool: KVPool) -> KVSetup:
    """The KV manager for ``pool`` and the streaming-eviction policy. Streaming eviction
    re-rotates kept keys, so their blocks no longer match a text hash and every block must
    be private: prefix caching and sibling sharing are off under it."""
    eviction = eviction_spec(config, pool)
    if pool.is_hybrid:  # per-group block tables over the shared pool
        kv = HybridKVCacheManager(pool.num_blocks, config.block_size, pool.layout,
                                  config.enable_prefix_caching,
                                  num_host_blocks=pool.num_host_blocks, cost=pool.swap_cost)
    else:
        kv = KVCacheManager(pool.num_blocks, config.block_size,
                            config.enable_prefix_caching and eviction is None,
                            num_host_blocks=pool.num_host_blocks, cost=pool.swap_cost,
                            share_siblings=eviction is None)
    stream = StreamingEviction(eviction, kv) if eviction is not None else None
    return KVSetup(kv, stream, eviction)
