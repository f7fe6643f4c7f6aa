"""Building the disk tier for an engine: its fingerprint from the loaded model, the store, the
facade. Kept apart from ``EngineCore`` so the core only wires hooks."""

from __future__ import annotations

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
        kv_layout=r.kv_format.layout, tp_rank=0, tp_size=config.tensor_parallel_size)


def build_disk_tier(config, core) -> DiskTier:
    """The disk tier of ``core`` (an ``EngineCore`` whose KV manager has a host tier).
    ValueError for a model whose layers mix sliding-window and full attention: its pool pages
    hold one KV group's layers each (engine.kv_cache.groups), which the tier does not key yet."""
    r = core.runner
    if r.kv_layout.is_hybrid:
        raise ValueError("--kv-disk-dir does not serve models that mix sliding-window and full "
                         "attention layers yet (their KV cache is hybrid, one block table per "
                         "layer group); start without it")
    fp = engine_fingerprint(config, core)
    block_bytes = r.kv_page_bytes_per_token * config.block_size
    store = DiskStore(config.disk_tier_config(), fp.digest, fp.hex, block_bytes)
    return DiskTier(store, core.kv, r.kv_caches, r.host_kv_caches, core.kv.host.cost,
                    settle_host=r.wait_host_copies)
