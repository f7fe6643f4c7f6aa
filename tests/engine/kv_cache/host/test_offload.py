"""Host KV tier: spill on eviction, host LRU, load-back, swap out/in, abort, integrity, costs.

Pools are tiny real tensors whose blocks hold a content id; copies run through the reference
``copy_blocks``; so each test checks what the blocks hold, not only what the manager claims.
"""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager, PrefixHit
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.host.blocks import SwapCostModel
from engine.kv_cache.host.tier import HostTier
from engine.models.arch import ModelArch
from engine.stats import HostTierStats
from tests.engine.kv_cache.host.test_offload_harness import Pools

BS = 4


def make(num_blocks=4, host_blocks=8, caching=True):
    m = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, num_host_blocks=host_blocks)
    return m, Pools(m)


def run(m, p, seq, tokens, salt=()):
    """Admit ``seq`` with a lookup, run its copies, compute the rest of its prompt."""
    hit = m.find_prefix(seq, tokens, salt)
    assert m.allocate(seq, len(tokens), hit) is not None
    p.flush()
    p.compute(seq, tokens, hit.num_tokens, len(tokens), salt)
    m.check_integrity()
    return hit


def spill(m, p, seq, tokens):
    """Run ``seq``, finish it, then fill the device pool so its cached blocks spill to host."""
    run(m, p, seq, tokens)
    m.free(seq)
    m.allocate("hog", 16)
    p.flush()
    m.free("hog")


def test_evicted_cached_blocks_spill_to_host_and_load_back():
    m, p = make()
    a = list(range(9))  # two full blocks and a partial one
    run(m, p, "a", a)
    m.free("a")
    assert m.allocate("hog", 16) is not None  # takes all four blocks: two cached ones evicted
    copies = p.flush()
    assert sorted(h for _, h in copies.d2h) == [0, 1] and not copies.h2d
    p.check_named()
    m.free("hog")
    assert m.find_prefix("probe", a + [1], record_stats=False).num_tokens == 8  # on the host
    m.free("probe")
    hit = run(m, p, "b", a + [50, 51])
    assert hit.block_ids == [] and len(hit.host_hashes) == 2 and hit.num_tokens == 8
    p.expect_table("b", a + [50, 51], 11)
    p.check_named()
    s = m.offload_stats()
    assert (s.blocks_d2h, s.blocks_h2d, s.host_prefix_hit_tokens, s.spills) == (2, 2, 8, 2)
    assert m.stats().prefix_cache_hits == 8  # both tiers count as hits


def test_device_hit_continues_on_host():
    m, p = make(num_blocks=5)
    a = list(range(13))  # three full blocks
    run(m, p, "a", a)
    m.free("a")
    # The uncached tail block and the spare go first, then the cached tail: blocks 2 and 1.
    m.allocate("hog", 16)
    p.flush()
    hit = m.find_prefix("b", a + [7])
    assert len(hit.block_ids) == 1 and len(hit.host_hashes) == 2 and hit.num_tokens == 12
    assert m.num_blocks_needed("b", 14, hit) == 1 + 3  # the free-cached head, 2 loads, 1 fresh
    assert m.allocate("b", 14, hit) is None  # only 1 free: nothing pinned, nothing changed
    assert not m.host.pending and m.host.pool.num_free_blocks == 8
    m.free("hog")
    assert m.allocate("b", 14, hit) is not None
    p.flush()
    p.expect_table("b", a + [7], 12)
    m.check_integrity()


def test_spill_is_skipped_when_host_has_the_hash():
    m, p = make()
    a = list(range(5))
    spill(m, p, "a", a)
    run(m, p, "b", a)  # loaded back from the host
    m.free("b")
    m.allocate("hog", 16)
    assert not m.host.pending.d2h  # the host already holds it: no second copy
    assert m.offload_stats().spills_skipped == 1
    p.flush()
    p.check_named()


def test_host_lru_evicts_the_oldest_spill():
    m, p = make(num_blocks=2, host_blocks=2)
    prompts = [[i * 10 + k for k in range(5)] for i in range(3)]  # one full block each
    for i, tokens in enumerate(prompts):
        run(m, p, f"s{i}", tokens)
        m.free(f"s{i}")
        m.allocate("hog", 8)  # evicts it: spill
        p.flush()
        m.free("hog")
        p.check_named()
    s = m.offload_stats()
    assert s.spills == 3 and s.host_evictions == 1 and s.host_blocks_cached == 2
    assert m.find_prefix("q0", prompts[0]).num_tokens == 0  # the oldest is gone
    assert m.find_prefix("q2", prompts[2]).num_tokens == 4
    assert m.find_prefix("q1", prompts[1]).num_tokens == 4
    for q in ("q0", "q1", "q2"):
        m.free(q)
    m.check_integrity()


def test_swap_round_trip_restores_the_kv_and_shares_what_survived():
    m, p = make(num_blocks=6, host_blocks=8)
    a = list(range(10))  # two full blocks + two tokens
    run(m, p, "a", a)
    assert m.swap_out("a", 10)
    assert m.is_swapped("a") and m.block_table("a") == [] and m.num_free_blocks == 6
    copies = p.flush()
    assert len(copies.d2h) == 3  # the partial block too
    # The device keeps the full blocks cached; the partial one is overwritten by a hog.
    m.allocate("hog", 4)
    p.flush()
    p.compute("hog", [99] * 4, 0, 4)
    table = m.swap_in("a", 11)
    assert table is not None and len(table) == 3
    copies = p.flush()
    assert len(copies.h2d) == 1  # only the unnamed partial block comes back by copy
    p.expect_table("a", a, 10)
    assert not m.is_swapped("a")
    p.compute("a", a + [5], 10, 11)  # it resumes where it stopped
    p.expect_table("a", a + [5], 11)
    m.check_integrity()


def test_swap_in_copies_blocks_the_device_lost():
    m, p = make(num_blocks=4, host_blocks=8)
    a = list(range(9))
    run(m, p, "a", a)
    assert m.swap_out("a", 9)
    p.flush()
    m.allocate("hog", 16)  # evicts a's cached blocks (the host has them: no spill copies)
    assert not m.host.pending.d2h
    p.flush()
    p.compute("hog", list(range(100, 116)), 0, 16)
    assert m.swap_in("a", 10) is None  # no room: nothing changes
    assert m.is_swapped("a")
    m.free("hog")
    assert m.swap_in("a", 10) is not None
    assert len(p.flush().h2d) == 3
    p.expect_table("a", a, 9)
    p.check_named()


def test_swap_out_falls_back_when_the_host_is_full():
    m, p = make(num_blocks=4, host_blocks=2)
    run(m, p, "a", list(range(9)))  # needs three host blocks
    before = (m.block_table("a"), m.offload_stats())
    assert not m.swap_out("a", 9)
    assert (m.block_table("a"), m.offload_stats()) == before and not m.host.pending
    assert m.swap_out("a", 8)  # two blocks fit (a caller swapping only computed full blocks)
    m.check_integrity()


def test_abort_of_a_swapped_sequence_leaves_nothing_behind():
    m, p = make()
    a = list(range(10))
    run(m, p, "a", a)
    assert m.swap_out("a", 10)
    m.free("a")  # abort before the copies even ran
    m.check_integrity()
    p.flush()
    m.free("a")  # idempotent
    s = m.offload_stats()
    assert s.host_blocks_used == 0 and s.num_swapped_seqs == 0
    assert s.host_blocks_cached == 2  # the named blocks stay as host prefix cache
    assert m.num_free_blocks == m.num_blocks
    p.check_named()
    run(m, p, "b", a + [3])  # and they are usable
    p.expect_table("b", a + [3], 11)


def test_swapping_out_a_block_still_waiting_for_its_load_uses_the_load_source():
    m, p = make(num_blocks=4, host_blocks=8)
    a = list(range(9))
    spill(m, p, "a", a)
    hit = m.find_prefix("b", a)
    assert len(hit.host_hashes) == 2
    m.allocate("b", 9, hit)  # two loads pending
    assert m.swap_out("b", 8)  # before the copies ran: its KV is only on the host
    copies = p.flush()
    assert copies.d2h == []  # nothing read from device blocks that do not hold it yet
    assert m.swap_in("b", 9) is not None
    p.flush()
    p.expect_table("b", a, 8)
    m.check_integrity()


def test_swap_out_again_before_the_swap_in_copies_ran_keeps_the_right_kv():
    m, p = make(num_blocks=4, host_blocks=8, caching=False)  # unnamed blocks: no lookups help
    a = list(range(6))
    run(m, p, "a", a)
    for _ in range(2):
        assert m.swap_out("a", 6)
        p.flush()
        m.allocate("hog", 16)  # overwrite every device block
        p.flush()
        p.compute("hog", list(range(100, 116)), 0, 16)
        m.free("hog")
        assert m.swap_in("a", 7) is not None  # loads pending into blocks holding hog's KV
        assert m.swap_out("a", 6)  # preempted again at once: must not copy those blocks
        assert p.flush().d2h == []
        assert m.swap_in("a", 7) is not None
        p.flush()
        p.expect_table("a", a, 6)


def test_swapped_sequences_refuse_live_operations():
    m, p = make()
    run(m, p, "a", list(range(6)))
    m.swap_out("a", 6)
    with pytest.raises(ValueError, match="swapped out"):
        m.allocate("a", 8)
    with pytest.raises(ValueError, match="swapped out"):
        m.find_prefix("a", list(range(6)))
    with pytest.raises(ValueError, match="swapped tokens"):
        m.swap_in("a", 5)
    with pytest.raises(ValueError, match="not swapped"):
        m.swap_in("zzz", 5)
    assert not m.swap_out("zzz", 4) and not m.swap_out("a", 6)


def test_reset_clears_both_tiers_and_caching_off_keeps_host_unnamed():
    m, p = make()
    run(m, p, "a", list(range(9)))
    m.free("a")
    m.allocate("hog", 16)
    p.flush()
    m.free("hog")
    assert m.offload_stats().host_blocks_cached == 2
    assert m.reset_prefix_cache() is True
    assert m.offload_stats().host_blocks_cached == 0
    m.check_integrity()
    m2, p2 = make(caching=False)
    run(m2, p2, "a", list(range(9)))
    assert m2.swap_out("a", 9)
    p2.flush()
    assert m2.host.pool.cached == {} and m2.swap_in("a", 10) is not None
    p2.flush()
    p2.expect_table("a", list(range(9)), 9)


def test_integrity_check_catches_a_lost_host_reference():
    m, p = make()
    run(m, p, "a", list(range(9)))
    m.swap_out("a", 9)
    p.flush()
    m.host.pool.free(m.host._swapped["a"].host_blocks[0])
    with pytest.raises(AssertionError, match="swapped holders"):
        m.check_integrity()


def test_plain_manager_refuses_host_hits_and_tier_needs_blocks():
    with pytest.raises(ValueError, match="no host tier"):
        KVCacheManager(4, BS).allocate("a", 8, PrefixHit([], 4, (), (b"x" * 32,)))
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(0, BlockPool(4), BS)


def _arch(hidden, layers, inter, heads, kv_heads):
    cfg = dict(model_type="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               max_position_embeddings=2048)
    return ModelArch.from_hf_config(cfg)


def test_cost_model_prefers_swap_for_big_models_and_recompute_for_tiny_ones_on_gpu():
    big = _arch(4096, 32, 14336, 32, 8)  # Llama-3-8B shape
    tiny = _arch(576, 30, 1536, 9, 3)  # SmolLM2-135M shape
    for arch, device, swap in ((big, "cuda", True), (big, "cpu", True), (tiny, "cpu", True),
                               (tiny, "cuda", False)):
        block_bytes = 16 * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
        cost = SwapCostModel.for_model(arch, device, block_bytes)
        # A 512-token sequence: 32 blocks out and back.
        assert cost.swap_is_cheaper(512, 32, 32) is swap, (arch.hidden_size, device)
    with pytest.raises(ValueError):
        SwapCostModel(-1.0, 0.0)
    assert HostTierStats.from_offload(None, 10).offload_bytes_d2h == 0
