"""KVCacheManager: allocation, prefix hits, registration, eviction order, sharing and stats."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager, PrefixHit

BS = 4


def snapshot(m: KVCacheManager):
    """Everything observable about the manager's state, for 'changes nothing' assertions."""
    return (
        {s: list(st.block_ids) for s, st in m._seqs.items()},
        [b.block_id for b in m.pool.free_queue],
        sorted((h, b.block_id) for h, b in m.pool.cached.items()),
        [(b.ref_count, b.block_hash) for b in m.pool.blocks],
        m.stats(),
    )


def run_prompt(m: KVCacheManager, seq: str, tokens: list[int], extra=()) -> PrefixHit:
    """Admit ``seq`` with a lookup, allocate its prompt and commit it as fully computed."""
    hit = m.find_prefix(seq, tokens, extra)
    assert m.allocate(seq, len(tokens), hit) is not None
    m.commit(seq, tokens, len(tokens), extra)
    m.check_integrity()
    return hit


def test_allocate_covers_exact_block_multiples_and_grows_incrementally():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    assert m.allocate("a", 8) == [0, 1]
    assert m.allocate("a", 8) == []  # already covered
    assert m.allocate("a", 9) == [2]  # one token over a multiple needs a block
    assert m.allocate("a", 12) == []
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_free_blocks == 5 and m.usage == pytest.approx(3 / 8)
    m.check_integrity()


def test_hit_is_capped_so_the_last_token_is_always_computed():
    m = KVCacheManager(8, BS)
    prompt = list(range(100, 108))  # exactly two blocks
    run_prompt(m, "a", prompt)
    # Same 8 tokens: only the first block may be reused, the last token must be recomputed.
    hit = m.find_prefix("b", prompt)
    assert hit.block_ids == [0] and hit.num_tokens == 4
    # One more token: both full blocks are reusable.
    hit = m.find_prefix("c", prompt + [1])
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8


def test_one_token_prompt_never_hits_and_registers_nothing():
    m = KVCacheManager(4, BS)
    hit = m.find_prefix("a", [5])
    assert hit.block_ids == [] and hit.num_tokens == 0
    assert m.allocate("a", 1, hit) == [0]
    m.commit("a", [5], 1)
    assert m.stats().num_cached_blocks == 0
    assert m.find_prefix("b", []).num_tokens == 0  # an empty lookup is harmless
    m.check_integrity()


def test_hit_shares_blocks_and_stats_count_tokens():
    m = KVCacheManager(8, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    run_prompt(m, "a", prompt)
    hit = m.find_prefix("b", prompt + [77, 78])
    assert hit.block_ids == [0, 1]
    assert m.allocate("b", 12, hit) == [3]
    assert m.block_table("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    s = m.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10 + 12, 8)
    assert s.prefix_cache_hits / s.prefix_cache_queries == pytest.approx(8 / 22)
    m.find_prefix("c", prompt, record_stats=False)
    assert m.stats().prefix_cache_queries == 22
    m.check_integrity()


def test_salt_separates_caches():
    m = KVCacheManager(8, BS)
    prompt = list(range(9))
    run_prompt(m, "a", prompt, extra=("tenant-1",))
    assert m.find_prefix("b", prompt, ("tenant-2",)).num_tokens == 0
    assert m.find_prefix("c", prompt).num_tokens == 0
    assert m.find_prefix("d", prompt, ("tenant-1",)).num_tokens == 8


def test_disabled_caching_never_hits_registers_or_counts():
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    run_prompt(m, "a", prompt)
    assert m.find_prefix("b", prompt + [1]).num_tokens == 0
    s = m.stats()
    assert (s.num_cached_blocks, s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0, 0)
    m.free("a")
    m.check_integrity()


def test_commit_is_incremental_over_decode_steps():
    m = KVCacheManager(8, BS)
    tokens = list(range(6))
    run_prompt(m, "a", tokens)
    assert m.num_committed_blocks("a") == 1 and m.stats().num_cached_blocks == 1
    for t in range(6, 13):  # decode: the sampled token is computed in the next step
        tokens.append(t)
        assert m.allocate("a", len(tokens)) is not None
        m.commit("a", tokens, len(tokens) - 1)
        m.check_integrity()
    # 13 tokens, 12 computed: three full blocks registered, each under its chained hash.
    assert m.num_committed_blocks("a") == 3
    assert m.find_prefix("b", tokens[:12] + [0]).block_ids == m.block_table("a")[:3]
    with pytest.raises(ValueError, match="computed tokens"):
        m.commit("a", tokens, len(tokens) + 1)
    m.commit("ghost", tokens, 4)  # unknown sequence: nothing to register


def test_duplicate_content_stays_private_and_first_holder_keeps_the_hash():
    m = KVCacheManager(8, BS)
    prompt = list(range(5))
    # Both admitted before either committed: no hit, two copies of the same block.
    for s in ("a", "b"):
        assert m.allocate(s, len(prompt), m.find_prefix(s, prompt)) is not None
    m.commit("a", prompt, 5)
    m.commit("b", prompt, 5)
    a0, b0 = m.block_table("a")[0], m.block_table("b")[0]
    assert m.pool.blocks[a0].block_hash is not None and m.pool.blocks[b0].block_hash is None
    assert m.find_prefix("c", prompt).block_ids == [a0]
    m.check_integrity()


def test_allocate_failure_changes_nothing_counting_free_cached_prefix_blocks():
    m = KVCacheManager(4, BS)
    prompt = list(range(9))
    run_prompt(m, "a", prompt)  # blocks 0, 1 cached; 2 holds the partial tail
    m.free("a")
    hit = m.find_prefix("b", prompt + list(range(50, 58)))  # 17 tokens: 5 blocks
    assert hit.block_ids == [0, 1]
    # 2 free-cached prefix blocks to take back + 3 fresh = 5 > 4 free.
    assert m.num_blocks_needed("b", 17, hit) == 5 and not m.can_allocate("b", 17, hit)
    before = snapshot(m)
    assert m.allocate("b", 17, hit) is None
    assert snapshot(m) == before
    m.check_integrity()
    # 16 tokens fit exactly: both cached blocks come back, two fresh ones are taken.
    assert m.num_blocks_needed("b", 16, hit) == 4 and m.can_allocate("b", 16, hit)
    assert sorted(m.allocate("b", 16, hit)) == [2, 3]
    assert m.block_table("b")[:2] == [0, 1] and m.num_free_blocks == 0
    m.check_integrity()


def test_eviction_is_lru_and_takes_a_sequence_tail_before_its_head():
    evicted = []
    m = KVCacheManager(7, BS, on_evict=lambda bid, h: evicted.append(bid))
    old, new = list(range(13)), list(range(500, 509))
    run_prompt(m, "old", old)  # blocks 0,1,2 cached, 3 holds the partial tail
    run_prompt(m, "new", new)  # blocks 4,5 cached, 6 partial
    m.free("old")
    m.free("new")
    assert m.allocate("x", 8) == [6, 3]  # uncached blocks go first, nothing is evicted
    assert evicted == []
    assert m.allocate("y", 8) is not None  # two evictions: the old sequence, tail first
    assert evicted == [2, 1]
    assert m.find_prefix("q", old + [0]).block_ids == [0]  # the head of the old prefix survives
    assert m.find_prefix("r", new + [0]).num_tokens == 8
    m.check_integrity()


def test_hit_on_free_cached_block_removes_it_from_eviction():
    m = KVCacheManager(3, BS)
    prompt = list(range(5))
    run_prompt(m, "a", prompt)
    m.free("a")
    hit = m.find_prefix("b", prompt)
    assert m.allocate("b", 5, hit) is not None  # touches block 0, takes one fresh block
    assert m.allocate("c", 4) is not None  # must not take block 0
    assert 0 not in m.block_table("c") and m.block_table("b")[0] == 0
    m.check_integrity()


def test_free_is_idempotent_and_unknown_sequences_are_ignored():
    m = KVCacheManager(4, BS)
    m.allocate("a", 9)
    m.free("a")
    m.free("a")
    m.free("never-seen")
    assert m.num_free_blocks == 4 and m.block_table("a") == []
    m.check_integrity()


def test_siblings_share_full_blocks_without_prefix_caching():
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    m.allocate("p.0", 10)  # 2 full blocks + partial
    table = m.block_table("p.0")
    share = PrefixHit(block_ids=table[:2], num_tokens=2 * BS)
    assert m.num_blocks_needed("p.1", 11, share) == 1  # shared blocks are in use: no cost
    assert m.allocate("p.1", 11, share) == [3]
    assert m.block_table("p.1") == table[:2] + [3]
    assert [m.pool.blocks[i].ref_count for i in table] == [2, 2, 1]
    m.check_integrity()
    m.free("p.0")
    assert m.num_free_blocks == 8 - 3  # p.1 still holds two shared blocks and its own
    m.free("p.1")
    assert m.num_free_blocks == 8
    m.check_integrity()


def test_malformed_or_stale_prefixes_are_refused_without_changes():
    m = KVCacheManager(4, BS)
    prompt = list(range(5))
    run_prompt(m, "a", prompt)
    m.free("a")
    hit = m.find_prefix("b", prompt)
    m.allocate("hog", 16)  # evicts block 0: the hit is stale now
    m.free("hog")
    before = snapshot(m)
    with pytest.raises(ValueError, match="stale prefix hit"):
        m.allocate("b", 5, hit)
    with pytest.raises(ValueError, match="must cover"):
        m.allocate("b", 5, PrefixHit([1], 3))
    with pytest.raises(ValueError, match="holds no KV"):
        m.allocate("b", 5, PrefixHit([1], BS))  # a free-uncached block has no content
    with pytest.raises(ValueError, match="outside the pool"):
        m.allocate("b", 5, PrefixHit([9], BS))
    with pytest.raises(ValueError, match="num_tokens"):
        m.allocate("b", -1)
    assert snapshot(m) == before
    m.allocate("c", 4)
    with pytest.raises(ValueError, match="already has blocks"):
        m.allocate("c", 8, PrefixHit(m.block_table("c"), BS))
    m.check_integrity()


def test_reset_prefix_cache_drops_free_hashes_only():
    m = KVCacheManager(8, BS)
    run_prompt(m, "a", list(range(9)))
    run_prompt(m, "b", list(range(100, 109)))
    m.free("a")
    assert m.reset_prefix_cache() is False  # b's blocks are in use and keep their hashes
    assert m.find_prefix("x", list(range(9))).num_tokens == 0
    assert m.find_prefix("y", list(range(100, 109))).num_tokens == 8
    m.free("b")
    assert m.reset_prefix_cache() is True
    s = m.stats()
    assert s.num_cached_blocks == 0 and s.num_free_blocks == 8
    m.check_integrity()


def test_stats_track_pool_states():
    m = KVCacheManager(8, BS)
    run_prompt(m, "a", list(range(9)))  # 2 cached + 1 partial
    m.allocate("b", 4)
    s = m.stats()
    assert (s.num_blocks, s.num_used_blocks, s.num_free_blocks) == (8, 4, 4)
    assert (s.num_cached_blocks, s.num_free_cached_blocks) == (2, 0)
    assert s.usage == pytest.approx(0.5)
    m.free("a")
    s = m.stats()
    assert (s.num_used_blocks, s.num_cached_blocks, s.num_free_cached_blocks) == (1, 2, 2)


def test_integrity_check_catches_a_table_the_refcounts_do_not_know():
    m = KVCacheManager(4, BS)
    m.allocate("a", 4)
    m._seqs["a"].block_ids.append(3)  # a block taken without a reference
    with pytest.raises(AssertionError, match="held by 1 tables"):
        m.check_integrity()
