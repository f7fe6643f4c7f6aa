"""BlockPool, FreeBlockQueue and block hashing, checked against plain-list and hashlib truths."""

from __future__ import annotations

import hashlib
from array import array

import numpy as np
import pytest

from engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv_cache.hashing import (
    ROOT_PARENT,
    compute_block_hashes,
    encode_extra_keys,
    hash_block,
)


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


# ------------------------------------------------------------------ FreeBlockQueue
def test_queue_matches_a_list_model():
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[:4])
    model = [0, 1, 2, 3]
    assert ids(q) == model and len(q) == 4

    q.remove(blocks[2])
    model.remove(2)
    q.appendleft(blocks[4])
    model.insert(0, 4)
    q.append(blocks[5])
    model.append(5)
    assert ids(q) == model and len(q) == len(model)

    assert q.popleft() is blocks[4]
    model.pop(0)
    q.remove(blocks[5])  # the tail
    model.pop()
    q.remove(blocks[0])  # the head
    model.pop(0)
    assert ids(q) == model == [1, 3]
    # A removed block is free to queue again; a queued one is not.
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[1])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 0]


def test_queue_rejects_double_insert_and_foreign_remove():
    a, b = KVBlock(0), KVBlock(1)
    q = FreeBlockQueue([a])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(a)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0 and ids(q) == []


# ------------------------------------------------------------------------ BlockPool
def test_fresh_pool_hands_out_lowest_ids_first():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in got)
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_uncached_blocks_are_reused_before_cached_ones_are_evicted():
    evicted = []
    pool = BlockPool(4, on_evict=lambda bid, h: evicted.append((bid, h)))
    b = pool.get_new_blocks(4)
    pool.register(b[0], b"h0")
    pool.register(b[1], b"h1")
    for blk in b:
        pool.free(blk)
    pool.check_integrity()
    assert pool.num_free_cached_blocks == 2
    # Uncached 2, 3 first (most recently freed first), then cached in the order they were freed.
    assert ids(pool.free_queue) == [3, 2, 0, 1]
    got = pool.get_new_blocks(3)
    assert [x.block_id for x in got] == [3, 2, 0]
    assert evicted == [(0, b"h0")]
    assert pool.lookup(b"h0") is None and got[2].block_hash is None
    assert pool.lookup(b"h1") is b[1]
    pool.check_integrity()


def test_touch_takes_a_cached_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(3)
    b = pool.get_new_blocks(3)
    for i, blk in enumerate(b):
        pool.register(blk, bytes([i]))
    for blk in b:
        pool.free(blk)
    assert ids(pool.free_queue) == [0, 1, 2]
    pool.touch(b[1])
    assert ids(pool.free_queue) == [0, 2] and b[1].ref_count == 1
    assert pool.num_free_cached_blocks == 2
    pool.touch(b[1])  # a second sharer: no queue change
    assert b[1].ref_count == 2 and pool.num_free_blocks == 2
    pool.check_integrity()
    pool.free(b[1])
    pool.free(b[1])
    assert ids(pool.free_queue) == [0, 2, 1]  # most recently used at the tail
    pool.check_integrity()


def test_register_keeps_the_first_holder_of_a_hash():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    assert pool.register(a, b"x")
    assert not pool.register(b, b"x")  # duplicate content stays private
    assert not pool.register(a, b"y")  # a block names one prefix only
    assert pool.lookup(b"x") is a and b.block_hash is None and pool.lookup(b"y") is None
    pool.check_integrity()


def test_free_underflow_is_refused():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.free(a)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(a)
    pool.check_integrity()


def test_evict_cached_free_blocks_keeps_in_use_hashes_and_skips_callback():
    evicted = []
    pool = BlockPool(3, on_evict=lambda *a: evicted.append(a))
    a, b, c = pool.get_new_blocks(3)
    pool.register(a, b"a")
    pool.register(b, b"b")
    pool.free(a)
    pool.free(c)
    assert pool.evict_cached_free_blocks() == 1
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is b
    assert evicted == [] and pool.num_free_cached_blocks == 0
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    a.ref_count = 0  # in no queue, yet "free"
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_integrity()
    a.ref_count = 1
    pool.cached[b"z"] = a  # map points at a block that does not hold the hash
    with pytest.raises(AssertionError, match="holds another hash"):
        pool.check_integrity()


def test_pool_size_is_validated():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


# -------------------------------------------------------------------------- hashing
def test_hash_matches_an_independent_sha256_of_the_documented_encoding():
    toks = [1, 2, 3, 50000]
    want0 = hashlib.sha256(ROOT_PARENT + array("q", toks).tobytes()).digest()
    assert hash_block(None, toks) == want0
    want1 = hashlib.sha256(want0 + array("q", [7, 8, 9, 10]).tobytes() + b"('s',)").digest()
    assert hash_block(want0, [7, 8, 9, 10], ("s",)) == want1


def test_chained_hashes_name_the_whole_prefix():
    a = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = compute_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial tail is not hashed
    assert a[1] != b[1]  # same block tokens, different history
    assert compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert compute_block_hashes(np.arange(1, 9), 4) == a  # numpy ids hash the same
    assert compute_block_hashes([1, 2, 3, 4], 4, ("salt",)) != a[:1]


def test_extra_keys_must_be_stably_encodable():
    assert encode_extra_keys(()) == b""
    assert encode_extra_keys(("a", 1, (None, b"x"))) == b"('a', 1, (None, b'x'))"
    with pytest.raises(ValueError, match="cannot be hashed stably"):
        encode_extra_keys((object(),))
    with pytest.raises(ValueError, match="must be a tuple"):
        encode_extra_keys(["salt"])  # type: ignore[arg-type]
