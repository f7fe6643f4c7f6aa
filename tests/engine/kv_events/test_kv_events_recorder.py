"""KV cache events from the KV manager's own operations (no model, no sockets): commits become
BlockStored runs whose parents chain, evictions BlockRemoved, spills to the host tier a
BlockStored with medium CPU carrying the block's tokens, a load back a GPU store again, a
rollback a removal, a reset AllBlocksCleared (then the blocks still in use, announced again);
a hybrid cache publishes per group with vLLM's group fields. The wire form holds only the
fields vllm-router accepts, and the recorder's catalog never outgrows the pools."""

from __future__ import annotations

import msgpack
import pytest

from engine.config.kv_events import KVEventsConfig
from engine.kv_cache import HybridKVCacheManager, KVCacheManager, plan_kv_groups
from engine.kv_cache.hashing import compute_block_hashes
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from engine.kv_events.wiring import attach

BS = 4
# vllm-router (kv_index decoder) refuses a batch holding any other field.
ALLOWED = {
    "BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
    "BlockRemoved": {"type", "block_hashes", "medium", "group_idx"},
    "AllBlocksCleared": {"type"},
}


class ListPublisher:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events) -> bool:
        if events:
            self.batches.append(list(events))
        return True

    def stats(self):
        return None

    def close(self) -> None:
        pass


def _attach(kv, layout=None):
    pub = ListPublisher()
    return attach(kv, layout=layout, publisher=pub), pub


def _events(kv_events, pub) -> list:
    kv_events.flush()
    out = [e for b in pub.batches for e in b]
    pub.batches.clear()
    return out


def _blocks(events) -> dict:
    """hash -> (parent, tokens) of every block the BlockStored ``events`` announce."""
    out = {}
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out[h] = (parent, e.token_ids[i * BS:(i + 1) * BS])
            parent = h
    return out


def _chain(tokens) -> dict:
    hashes = compute_block_hashes(tokens, BS)
    return {h: (hashes[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]))
            for i, h in enumerate(hashes)}


def test_commits_are_stored_runs_whose_parents_chain():
    kv = KVCacheManager(32, BS)
    ev, pub = _attach(kv)
    tokens = list(range(100, 122))  # 5 full blocks and 2 tokens
    hashes = compute_block_hashes(tokens, BS)
    kv.allocate("a", len(tokens))
    stored = []
    for done in (8, 16, 22):  # three prefill chunks
        kv.commit("a", tokens, done)
        step = _events(ev, pub)
        assert all(isinstance(e, BlockStored) and e.medium == "GPU" for e in step)
        stored += step
    assert [len(e.block_hashes) for e in stored] == [2, 2, 1]
    assert stored[0].parent_block_hash is None
    for prev, e in zip(stored, stored[1:]):
        assert e.parent_block_hash == prev.block_hashes[-1]
    assert [h for e in stored for h in e.block_hashes] == hashes
    assert [t for e in stored for t in e.token_ids] == tokens[:20]
    # a second sequence sharing the prefix announces only its own new block
    other = tokens[:8] + [7, 7, 7, 7, 1]
    hit = kv.find_prefix("b", other)
    kv.allocate("b", len(other), hit)
    kv.commit("b", other, 12)
    (e,) = _events(ev, pub)
    assert e.parent_block_hash == hashes[1] and e.token_ids == (7, 7, 7, 7)


def test_eviction_removes_and_the_catalog_stays_bounded():
    kv = KVCacheManager(6, BS)
    ev, pub = _attach(kv)
    first = list(range(24))
    kv.allocate("a", 24)
    kv.commit("a", first, 24)
    kv.free("a")
    stored = _events(ev, pub)
    assert sum(len(e.block_hashes) for e in stored) == 6
    second = list(range(50, 74))
    kv.allocate("b", 24)  # takes every block: all of a's hashes go
    kv.commit("b", second, 24)
    events = _events(ev, pub)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(compute_block_hashes(first, BS))
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
    assert ev.recorder.num_described == len(kv.pool.cached) == 6
    kv.check_integrity()


def test_host_tier_spill_and_load_back():
    kv = KVCacheManager(8, BS, num_host_blocks=16)
    ev, pub = _attach(kv)
    a = list(range(16))
    kv.allocate("a", 16)
    kv.commit("a", a, 16)
    kv.free("a")
    _events(ev, pub)
    kv.allocate("b", 32)  # evicts a's 4 blocks: each spills to the host first
    kv.flush_copies(lambda d2h, h2d: None)
    events = _events(ev, pub)
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    gone = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"
            for h in e.block_hashes]
    assert _blocks(cpu) == _chain(a)  # the tail is evicted first: runs of one block
    assert sorted(gone) == sorted(_chain(a))
    kv.free("b")
    hit = kv.find_prefix("c", a + [1])  # the host holds a: loaded back into device blocks
    assert len(hit.host_hashes) == 4
    assert kv.allocate("c", 17, hit) is not None
    kv.flush_copies(lambda d2h, h2d: None)
    back = [e for e in _events(ev, pub) if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert _blocks(back) == _chain(a)
    kv.check_integrity()


def test_rollback_removes_and_reset_clears_then_announces_what_is_in_use():
    kv = KVCacheManager(16, BS)
    ev, pub = _attach(kv)
    t = list(range(12))
    kv.allocate("a", 12)
    kv.commit("a", t, 12)
    kv.allocate("x", 8)
    kv.commit("x", list(range(40, 48)), 8)
    kv.free("x")
    _events(ev, pub)
    kv.truncate("a", 10)  # the last block becomes partial: no longer a cache entry
    (e,) = _events(ev, pub)
    assert isinstance(e, BlockRemoved) and e.block_hashes == (compute_block_hashes(t, BS)[2],)
    assert not kv.reset_prefix_cache()  # a's blocks are in use: they keep their hashes
    events = pub.batches[-1]  # the reset flushed at once, no step needed
    assert isinstance(events[0], AllBlocksCleared)
    (again,) = events[1:]
    assert again.block_hashes == tuple(compute_block_hashes(t, BS)[:2])
    assert again.parent_block_hash is None and again.token_ids == tuple(t[:8])
    assert ev.recorder.num_described == 2


def test_hybrid_cache_publishes_per_group():
    layout = plan_kv_groups((None, 8))  # one full layer, one window layer
    kv = HybridKVCacheManager(32, BS, layout)
    ev, pub = _attach(kv, layout)
    t = list(range(9))
    kv.allocate("a", 9)
    kv.commit("a", t, 8)
    events = _events(ev, pub)
    by_group = {e.group.group_idx: e for e in events}
    assert set(by_group) == {0, 1}
    assert by_group[0].to_wire()["kv_cache_spec_kind"] == "full_attention"
    wire = by_group[1].to_wire()
    assert wire["kv_cache_spec_kind"] == "sliding_window"
    assert wire["kv_cache_spec_sliding_window"] == 8
    assert by_group[0].block_hashes != by_group[1].block_hashes  # salted per group
    assert by_group[0].token_ids == by_group[1].token_ids == tuple(t[:8])


def test_wire_form_is_vllms_tagged_maps():
    events = (BlockStored((b"a" * 32, b"b" * 32), None, tuple(range(8)), BS),
              BlockRemoved((b"a" * 32,), "CPU"), AllBlocksCleared())
    ts, decoded, rank = msgpack.unpackb(EventBatch(1.5, events).encode())
    assert (ts, rank) == (1.5, 0)
    for e in decoded:
        assert isinstance(e, dict) and set(e) <= ALLOWED[e["type"]]
    assert decoded[0]["block_hashes"] == [b"a" * 32, b"b" * 32]  # msgpack bin
    assert decoded[0]["parent_block_hash"] is None and decoded[0]["block_size"] == BS
    assert decoded[1] == {"type": "BlockRemoved", "block_hashes": [b"a" * 32], "medium": "CPU"}
    with pytest.raises(ValueError, match="token ids"):
        BlockStored((b"a" * 32,), None, (1, 2), BS)


def test_config_reads_vllms_json_and_refuses_mistakes():
    off = KVEventsConfig.from_value(None)
    assert not off.active and off.publisher == "null"
    on = KVEventsConfig.from_value('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.active and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    assert KVEventsConfig.from_value(on.as_dict()) == on
    assert not KVEventsConfig.from_value({"enable_kv_cache_events": True,
                                          "publisher": "null"}).active
    for bad, msg in [('{"enable_kv_cache_events": true, "endpont": "x"}', "unknown"),
                     ("{not json", "not valid JSON"),
                     ({"endpoint": "localhost:5557"}, "ZMQ address"),
                     ({"publisher": "kafka"}, "publisher"),
                     ({"max_queue_size": 0}, "max_queue_size"),
                     ({"enable_kv_cache_events": "yes"}, "true or false"),
                     ({"replay_endpoint": "tcp://*:5557"}, "differ")]:
        with pytest.raises(ValueError, match=msg):
            KVEventsConfig.from_value(bad)
