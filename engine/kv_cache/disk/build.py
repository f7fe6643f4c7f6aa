"""Building the disk tier for an engine: its fingerprint from the loaded model, the store, the
facade. Kept apart from ``EngineCore`` so the core only wires hooks. With ``--kv-remote-url``
the facade drives a ``ChainStore``: the disk store (if any) then the remote one
(``engine.kv_cache.remote``), under the same fingerprint.

Under tensor parallelism every rank stores its own share of each block (its KV heads) under
its own fingerprint (``tp_rank``): a sub-directory and remote key prefix of its own. Rank 0's
facade decides and each worker does its share's I/O (``engine.distributed.kv_tiers``); the
workers build their stores with :func:`build_store` and :func:`rank_fingerprint` too."""

from __future__ import annotations

from dataclasses import replace

from engine.kv_cache.disk.fingerprint import KVFingerprint, config_digest, weights_identity
from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.disk.tier import DiskTier
from engine.kv_cache.remote.chain import ChainStore
from engine.kv_cache.remote.store import RemoteStore


def engine_fingerprint(config, core) -> KVFingerprint:
    """Everything that gives this engine's KV bytes their meaning (``fingerprint`` module);
    under tensor parallelism, rank 0's share's."""
    return rank_fingerprint(config, core.runner, core.files.path, core.hf_config, tp_rank=0)


def rank_fingerprint(config, r, files_path, hf_config, tp_rank: int) -> KVFingerprint:
    """The fingerprint of rank ``tp_rank``'s share of the KV (``r``: a runner of the model;
    the layout fields are the whole model's, the rank and size name the share)."""
    return KVFingerprint(
        weights=weights_identity(files_path, f"{config.load_format}|{config.seed}"),
        model_config=config_digest(hf_config),
        # the runner's resolved KV dtype ("auto" is still in a worker's config)
        dtype=str(r.dtype), kv_cache_dtype=str(r.kv_cache_dtype),
        block_size=config.block_size, num_layers=r.arch.num_layers,
        num_kv_heads=r.arch.num_kv_heads, row_bytes=r.kv_format.row_bytes,
        quantization=(f"{config.quantization}|{r.linear_backend}|"
                      f"{config.calculate_kv_scales}"),
        kv_layout=r.kv_format.layout + _groups_key(r.kv_layout), tp_rank=tp_rank,
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
    store = build_store(config, r, engine_fingerprint(config, core))
    tier = DiskTier(store, core.kv, device_pools(r), r.host_kv_caches, core.kv.host.cost,
                    settle_host=r.wait_host_copies)
    shards = getattr(r, "stored_tier_shards", None)  # tensor parallelism: the workers' shares
    tier.shards = shards() if shards is not None else None
    return tier


def device_pools(r) -> list:
    """The distinct device pool tensors of runner ``r``: group 0's layers hold slots 0, 1, ...
    in order (a hybrid cache's slots, not one entry per layer)."""
    return [r.kv_caches[layer] for layer in r.kv_layout.groups[0].layers]


def staging_blocks(r, config, max_model_len: int) -> int:
    """The host blocks the stored tier loads through when ``swap_space`` is 0: one context's
    (every KV group's, for a hybrid cache), and a few more."""
    return r.kv_layout.blocks_for(max_model_len, config.block_size) + 8


def build_store(config, r, fp: KVFingerprint):
    """The store under fingerprint ``fp`` for runner ``r``'s pools: a ``DiskStore``, or with
    ``kv_remote_url`` a ``ChainStore`` (disk then remote, or remote alone)."""
    block_bytes = r.kv_page_bytes_per_token * config.block_size
    groups = r.kv_layout.num_groups
    # a hybrid cache writes one record per group for each block of tokens: its writer queue
    # holds as many blocks of tokens (the same bytes) as a one-group model's
    tier = config.disk_tier_config()
    store = None
    if tier is not None:
        tier = replace(tier, queue_blocks=tier.queue_blocks * groups)
        store = DiskStore(tier, fp.digest, fp.hex, block_bytes)
    remote = config.remote_tier_config()
    if remote is not None:
        remote = replace(remote, queue_blocks=remote.queue_blocks * groups)
        store = ChainStore(store, RemoteStore(remote, fp.digest, fp.hex, block_bytes))
    return store
