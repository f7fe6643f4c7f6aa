"""``/kv/state``'s JSON: a :class:`engine.kv_cache.snapshot.KVSnapshot` as plain data, with the
shared prefixes' first tokens as text and the §3.1 arithmetic for the running configuration.

The document (``"version": 1``; every count in blocks unless named ``*_tokens`` / ``*bytes``)
is spelled out key by key on :func:`state_document`: the snapshot's number and time, each KV
tier's block counts (device first), one letter per device block, every request's blocks, the
hybrid KV groups, the prefix cache's hits and largest shared prefixes, cumulative counters and
the bytes-per-token arithmetic.

``/kv/events`` sends the same document as ``event: state`` whenever it changed (checked every
``interval`` seconds), and ``: ping`` comments in between."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.kv_cache.snapshot import BLOCK_STATES, KVSnapshot

VERSION = 1


def state_document(snap: KVSnapshot, decode: Callable[[tuple[int, ...]], str]) -> dict[str, Any]:
    """The JSON-able document of ``snap``; ``decode`` turns token ids into text (the page
    escapes it: it is inserted as text, never as HTML). The document (``"version": 1``; every
    count in blocks unless named ``*_tokens`` / ``*bytes``)::

        seq_no, time                 snapshot number (grows by one each) and unix time
        block_size, prefix_caching
        tiers: [{name, num_blocks, free, cached_free, used, cached}]   device first; host, disk
                                     when present (free + cached_free + used == num_blocks)
        blocks: "ffuusc..."          one letter per device block: f free, c cached and
                                     evictable, u in use, s in use and shared (``legend``)
        requests: [{seq_id, request_id, num_tokens, num_computed_tokens, num_blocks, block_ids,
                    num_shared_blocks, shared_tokens, num_cached_tokens, swapped,
                    groups: [{group, num_blocks, block_ids}]}]      num_blocks: every group's;
                                     block_ids: group 0's; ``groups`` empty unless hybrid
        kv_groups: [{group, num_layers, window}]   hybrid KV layouts (one table per group and
                                     sequence over the one pool); empty otherwise
        prefix_cache: {queries_tokens, hits_tokens, hit_rate,
                       top: [{num_tokens, num_requests, text}]}      the largest shared prefixes
        counters: {evictions, spills, loads, offloads, host_evictions}   cumulative
        arithmetic: {num_layers, num_kv_heads, head_dim, kv_cache_dtype, row_bytes,
                     bytes_per_token, bytes_per_block, formula, max_model_len,
                     bytes_per_max_len_seq, live_tokens, reserved_tokens, live_fraction}
                                     live_tokens: slots of device blocks holding computed KV (a
                                     shared block once); reserved_tokens: used blocks x block_size
    """
    g = snap.geometry
    bs = g.block_size
    seqs = [{
        "seq_id": s.seq_id, "request_id": s.request_id, "num_tokens": s.num_tokens,
        "num_computed_tokens": s.num_computed_tokens, "num_blocks": s.num_blocks,
        "block_ids": list(s.block_ids), "num_shared_blocks": s.num_shared_blocks,
        "shared_tokens": s.num_shared_blocks * bs, "num_cached_tokens": s.num_cached_tokens,
        "swapped": s.swapped,
        "groups": [{"group": g, "num_blocks": n, "block_ids": list(ids)} for g, (n, ids)
                   in enumerate(zip(s.group_num_blocks, s.group_block_ids, strict=True))],
    } for s in snap.seqs]
    c = snap.counters
    live = snap.live_tokens
    device = snap.tiers[0]
    reserved = device.used * bs
    return {
        "version": VERSION,
        "seq_no": snap.seq_no,
        "time": snap.time,
        "block_size": bs,
        "prefix_caching": snap.prefix_caching,
        "tiers": [t.__dict__.copy() for t in snap.tiers],
        "blocks": snap.blocks,
        "legend": BLOCK_STATES,
        "requests": seqs,
        "kv_groups": [{"group": k.group, "num_layers": k.num_layers, "window": k.window}
                      for k in snap.groups],
        "prefix_cache": {
            "queries_tokens": c.prefix_queries, "hits_tokens": c.prefix_hits,
            "hit_rate": round(c.hit_rate, 6),
            "top": [{"num_tokens": p.num_tokens, "num_requests": p.num_requests,
                     "text": decode(p.first_token_ids)} for p in snap.shared_prefixes],
        },
        "counters": {"evictions": c.evictions, "spills": c.spills, "loads": c.loads,
                     "offloads": c.offloads, "host_evictions": c.host_evictions},
        "arithmetic": {
            "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim, "kv_cache_dtype": g.kv_cache_dtype,
            "row_bytes": g.row_bytes, "bytes_per_token": g.bytes_per_token,
            "bytes_per_block": g.bytes_per_block,
            "formula": (f"2 (K,V) x {g.num_layers} layers x {g.num_kv_heads} KV heads x "
                        f"{g.row_bytes} bytes ({g.head_dim} x {g.kv_cache_dtype}) = "
                        f"{g.bytes_per_token} bytes/token"),
            "max_model_len": g.max_model_len,
            "bytes_per_max_len_seq": g.bytes_per_token * g.max_model_len,
            "live_tokens": live, "reserved_tokens": reserved,
            "live_fraction": round(live / reserved, 6) if reserved else None,
        },
    }


class PrefixText:
    """Token ids -> text through the tokenizer, remembered (a prefix is decoded once)."""

    def __init__(self, tokenizer: Any, capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._memo: dict[tuple[int, ...], str] = {}

    def __call__(self, ids: tuple[int, ...]) -> str:
        text = self._memo.get(ids)
        if text is None:
            try:
                text = self.tokenizer.decode(list(ids))
            except Exception:  # noqa: BLE001 - an odd tokenizer must not break the page
                text = " ".join(map(str, ids))
            if len(self._memo) >= self.capacity:
                self._memo.clear()
            self._memo[ids] = text
        return text
