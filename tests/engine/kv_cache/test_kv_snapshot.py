"""``engine.kv_cache.snapshot`` against the manager's own bookkeeping (an independent count:
``KVCacheManager.stats`` and ``check_integrity``), and §5.3's precision rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.kv_cache.groups import plan_kv_groups
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.snapshot import (
    KVGeometry,
    KVGroupView,
    KVSnapshotter,
    PrefixTracker,
    TierState,
)
from engine.kv_format.precision import kv_precision_warning
from server.kv_page.state import state_document


@dataclass
class _Req:
    request_id: str
    num_cached_tokens: int | None = None


@dataclass
class _Seq:
    seq_id: str
    request: _Req
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


GEOM = KVGeometry(num_layers=2, num_kv_heads=3, head_dim=8, kv_cache_dtype="float16",
                  row_bytes=16, block_size=4, max_model_len=64)


def test_snapshot_counts_states_and_sharing():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, num_host_blocks=4)
    snap = KVSnapshotter(kv, GEOM)
    prompt = list(range(13))
    a = _Seq("a", _Req("ra"), prompt, 13)
    kv.find_prefix("a", prompt)
    kv.allocate("a", 13)
    kv.commit("a", prompt, 13)
    b = _Seq("b", _Req("rb"), prompt[:12] + [99], 13)
    hit = kv.find_prefix("b", b.token_ids)
    b.request.num_cached_tokens = hit.num_tokens
    kv.allocate("b", 13, prefix=hit)
    kv.check_integrity()
    s = snap.take([a, b])
    stats = kv.stats()
    dev = s.tier("device")
    assert dev.num_blocks == 16 and dev.used == stats.num_used_blocks == 5
    assert dev.free + dev.cached_free + dev.used == dev.num_blocks
    assert s.tier("host") == TierState("host", 4, 4, 0, 0, 0)
    assert s.blocks.count("s") == 3 and s.blocks.count("u") == 2
    sa, sb = s.seqs
    assert sa.num_shared_blocks == sb.num_shared_blocks == 3
    assert sb.num_cached_tokens == 12 and sb.block_ids[:3] == sa.block_ids[:3]
    assert s.live_tokens == 12 + 1 + 1  # the shared blocks count once
    (top,) = s.shared_prefixes
    assert top.num_tokens == 12 and top.num_requests == 2 and top.first_token_ids == tuple(
        range(12))
    assert s.counters.prefix_hits == stats.prefix_cache_hits == 12
    kv.free("a")
    kv.free("b")
    s2 = snap.take([])
    assert s2.seq_no == s.seq_no + 1 and s2.tier("device").used == 0
    assert s2.blocks.count("c") == s2.tier("device").cached_free == kv.stats().num_free_cached_blocks
    assert GEOM.bytes_per_token == 2 * 2 * 3 * 16


def test_evictions_are_counted():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    snap = KVSnapshotter(kv, GEOM)
    toks = [1, 2, 3, 4, 5]
    kv.find_prefix("a", toks)
    kv.allocate("a", 5)
    kv.commit("a", toks, 5)
    kv.free("a")  # two cached blocks, free
    kv.allocate("b", 8)  # needs all four: evicts both
    assert snap.take([]).counters.evictions == 2


def test_hybrid_layout_shows_every_group():
    """One table per KV group: the window group has given back the blocks that slid out;
    the snapshot and the page's document count and list both groups."""
    kv = HybridKVCacheManager(32, 4, plan_kv_groups((None, 8, 8, None)), True)
    snap = KVSnapshotter(kv, GEOM)
    toks = list(range(30))
    kv.find_prefix("a", toks)
    kv.allocate("a", 30)
    kv.commit("a", toks, 30)
    kv.release_outside_window("a", 30)
    s = snap.take([_Seq("a", _Req("ra"), toks, 30)])
    full, window = (kv.group_tables("a")[g] for g in (0, 1)) if kv.layout.windows[0] is None \
        else (kv.group_tables("a")[g] for g in (1, 0))
    assert sum(b >= 0 for b in window) < sum(b >= 0 for b in full) == 8
    assert {g.window for g in s.groups} == {None, 8} and all(
        isinstance(g, KVGroupView) and g.num_layers == 2 for g in s.groups)
    (seq,) = s.seqs
    assert seq.num_blocks == sum(seq.group_num_blocks) == s.tier("device").used
    assert seq.group_block_ids == tuple(tuple(t) for t in kv.group_tables("a"))
    assert s.live_tokens == sum(min(4, 30 - 4 * i) for t in kv.group_tables("a")
                                for i, b in enumerate(t) if b >= 0)
    doc = state_document(s, lambda ids: "")
    assert [g["window"] for g in doc["kv_groups"]] == [g.window for g in s.groups]
    assert [g["num_blocks"] for g in doc["requests"][0]["groups"]] == list(seq.group_num_blocks)


def test_tracker_keeps_the_longest():
    t = PrefixTracker(capacity=2)
    t.observe(8, "r1", list(range(8)))
    t.observe(16, "r2", list(range(16)))
    t.observe(4, "r3", [7, 7, 7, 7])  # full: the shortest entry goes
    assert [p.num_tokens for p in t.top()] == [16, 4]
    with pytest.raises(ValueError, match="capacity"):
        PrefixTracker(0)


@pytest.mark.parametrize("kv, compute, trained, warns", [
    ("float16", "torch.float32", "torch.bfloat16", "narrower range"),  # the seed's case
    ("float16", "bfloat16", None, "narrower range"),
    ("float16", "float32", "float16", None),
    ("float16", "float32", "float32", None),  # the CPU default under a float32 checkpoint
    ("bfloat16", "bfloat16", "bfloat16", None),
    ("bfloat16", "float16", None, "mantissa"),
    ("fp8_e4m3", "bfloat16", "bfloat16", None),  # 8-bit caches: an explicit, scaled choice
    ("float32", "float32", "bfloat16", None),
])
def test_precision_rule(kv, compute, trained, warns):
    got = kv_precision_warning(kv, compute, trained)
    assert (got is None) == (warns is None)
    if warns:
        assert warns in got and "--kv-cache-dtype" in got
