"""Dropping the prefix cache's unheld blocks, tier by tier (``POST /reset_prefix_cache``).

``kv`` is the scheduler's KV manager (its ``host`` tier, if any, inside it); ``disk`` the
stored tiers' facade (``engine.kv_cache.disk.tier``) or None. ``EngineCore`` delegates here.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

logger = logging.getLogger("kvserve.engine")


def cache_tiers(kv, disk) -> list[str]:
    """The tiers the prefix cache lives in, top down: "device", then "host" (``swap_space``,
    or the staging area of a stored tier), "disk" and "remote" when on. Fixed at start."""
    return (["device"] + (["host"] if kv.host is not None else [])
            + (disk.tier_names() if disk is not None else []))


def reset_prefix_cache(kv, disk, tiers: Collection[str] | None = None,
                       ) -> dict[str, int | None]:
    """Drop every cached block no request holds, in ``tiers`` (None: all of
    :func:`cache_tiers`): their KV is forgotten, not written anywhere. Blocks in use by a
    running, waiting or swapped request, or pinned by a pending copy, keep their KV and
    hash. Returns the blocks dropped per tier (None: a stored tier that cannot be cleared
    from here). ValueError naming a tier this engine does not have. Engine thread only,
    between steps (``AsyncEngine.reset_prefix_cache``); the scheduler's manager and host
    tier are changed only through their own resets."""
    have = cache_tiers(kv, disk)
    want = have if tiers is None else list(dict.fromkeys(tiers))
    unknown = [t for t in want if t not in have]
    if unknown:
        raise ValueError(f"no {', '.join(unknown)} KV tier on this server; its tiers: "
                         f"{', '.join(have)}")
    out: dict[str, int | None] = {}
    if "device" in want:
        pool = kv.pool
        before = pool.num_free_cached_blocks
        kv.reset_prefix_cache(host=False)
        out["device"] = before - pool.num_free_cached_blocks
    if "host" in want:
        pool = kv.host.pool
        before = pool.num_free_cached_blocks
        kv.host.reset()
        out["host"] = before - pool.num_free_cached_blocks
    stored = [t for t in want if t not in ("device", "host")]
    if stored:
        out.update(disk.clear(stored))
    logger.info("prefix cache reset: %s", ", ".join(
        f"{t} {'not cleared' if n is None else f'{n} blocks dropped'}"
        for t, n in out.items()))
    return out
