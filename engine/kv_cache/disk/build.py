"""Building the disk tier for an engine: its fingerprint from the loaded model, the store, the
facade. Kept apart from ``EngineCore`` so the core only wires hooks."""

from __future__ import annotations

from dataclasses import replace

from engine.kv_cache.disk.fingerprint import KVFingerprint, config_digest, weights_identity
from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.disk.tier import DiskTier


def engine_fingerprint(config, core) -> KVFingerprint:
    """Everything that gives this engine's KV bytes their meaning (``fingerprint`` module)."""
    r = core.runner
    return KVFingerprint(
        weights=weights_identity(core.files.path, f"{config.load_format}|{config.seed}"),
        model_config=config_digest(core.hf_config),
        dtype=str(r.dtype), kv_cache_dtype=str(config.kv_cache_dtype),
        block_size=config.block_size, num_layers=r.arch.num_layers,
        num_kv_heads=r.arch.num_kv_heads, row_bytes=r.kv_format.row_bytes,
        quantization=(f"{config.quantization}|{r.linear_backend}|"
                      f"{config.calculate_kv_scales}"),
        kv_layout=r.kv_format.layout + _groups_key(r.kv_layout), tp_rank=0,
        tp_size=config.tensor_parallel_size)


def _groups_key(layout) -> str:
    """A hybrid KV cache's groups (each group's layers and window: what a pool block holds);
    empty for one group, so the classic layout's fingerprint is what it always was."""
    if not layout.is_hybrid:
        return ""
    return "|groups=" + ";".join(f"{','.join(map(str, g.layers))}:{g.window}"
                                 for g in layout.groups)


def build_disk_tier(config, core) -> DiskTier:
    """The disk tier of ``core`` (an ``EngineCore`` whose KV manager has a host tier). A hybrid
    KV cache (layers mixing sliding-window and full attention) stores one group's page per
    block, under that group's salted hashes (``engine.kv_cache.disk.plan``)."""
    r = core.runner
    fp = engine_fingerprint(config, core)
    block_bytes = r.kv_page_bytes_per_token * config.block_size
    tier = config.disk_tier_config()
    # a hybrid cache writes one record per group for each block of tokens: its writer queue
    # holds as many blocks of tokens (the same bytes) as a one-group model's
    tier = replace(tier, queue_blocks=tier.queue_blocks * r.kv_layout.num_groups)
    store = DiskStore(tier, fp.digest, fp.hex, block_bytes)
    # the distinct pool tensors: group 0's layers hold slots 0, 1, ... in order
    device = [r.kv_caches[layer] for layer in r.kv_layout.groups[0].layers]
    return DiskTier(store, core.kv, device, r.host_kv_caches, core.kv.host.cost,
                    settle_host=r.wait_host_copies)
