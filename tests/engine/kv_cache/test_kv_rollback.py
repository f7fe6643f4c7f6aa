"""KVCacheManager.truncate, the KV side of speculative decoding: a verification step allocates
for every drafted token, then the table is cut back to the accepted ones. Blocks wholly past
them are freed, refcounts stay right with prefix sharing and n > 1 siblings, and no block that
held a rejected token's K/V is ever hashed, cached, spilled or swapped to the host tier."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheManager
from engine.kv_cache.hashing import extend_block_hashes

BS = 4


def _hashes(tokens: list[int], n: int) -> list:
    out: list = []
    extend_block_hashes(out, tokens, BS, n, b"")
    return out


def _verify_step(m: KVCacheManager, seq: str, tokens: list[int], computed: int,
                 draft: list[int], accepted: int, next_token: int) -> tuple[list[int], int]:
    """One speculative step as the scheduler runs it: allocate for the pending token plus the
    draft, commit the pending token, then keep ``accepted`` drafts + the target's token."""
    assert m.allocate(seq, computed + 1 + len(draft)) is not None
    computed += 1
    m.commit(seq, tokens, computed)
    tokens = tokens + draft[:accepted] + [next_token]
    computed += accepted
    m.truncate(seq, len(tokens))
    m.commit(seq, tokens, computed)
    m.check_integrity()
    return tokens, computed


def test_rejected_blocks_are_freed_and_never_hashed():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6]
    m.allocate("a", len(prompt))
    m.commit("a", prompt, len(prompt) - 1)
    tokens = prompt  # the last prompt token is pending (its logits sample)
    computed = len(prompt) - 1
    # Pending token at position 5, draft of 8 at positions 6..13: the table grows to 4 blocks.
    draft = [50, 51, 52, 53, 54, 55, 56, 57]
    before_free = m.num_free_blocks
    assert m.allocate("a", computed + 1 + len(draft)) == [2, 3]
    freed = m.num_free_blocks
    assert freed == before_free - 2
    computed += 1
    m.commit("a", tokens, computed)
    # One draft token accepted (position 6), the target's token at 7 is pending: 8 tokens.
    tokens = tokens + [50, 99]
    computed += 1
    m.truncate("a", len(tokens))
    m.commit("a", tokens, computed)
    m.check_integrity()
    assert m.block_table("a") == [0, 1]  # blocks 2 and 3 held only rejected drafts
    assert m.num_free_blocks == before_free
    assert m.pool.blocks[2].block_hash is None and m.pool.blocks[3].block_hash is None
    # Only the first block is full AND computed: one hash, of accepted tokens only.
    assert set(m.pool.cached) == {_hashes(tokens, 1)[0]}
    rejected = _hashes(prompt + draft, 3)
    assert not set(rejected[1:]) & set(m.pool.cached)
    # The next step computes 99 and fills block 1 with accepted tokens only.
    tokens, computed = _verify_step(m, "a", tokens, computed, [7, 7, 7], 0, 8)
    assert set(m.pool.cached) == set(_hashes(tokens, 2))
    m.free("a")
    m.check_integrity()
    assert m.num_free_blocks == 16


def test_a_cut_inside_a_cached_private_block_unregisters_it():
    m = KVCacheManager(8, BS)
    tokens = list(range(10))
    m.allocate("a", 10)
    m.commit("a", tokens, 10)
    assert len(m.pool.cached) == 2
    m.truncate("a", 6)  # block 1 becomes partial: it will be written again
    m.check_integrity()
    assert m.block_table("a") == [0, 1, ] and len(m.pool.cached) == 1
    assert m.pool.blocks[1].block_hash is None and m.num_committed_blocks("a") == 1
    m.allocate("a", 8)
    m.commit("a", tokens[:6] + [70, 71], 8)  # recommitted with its new content
    assert m.pool.blocks[1].block_hash == _hashes(tokens[:6] + [70, 71], 2)[1]
    m.check_integrity()


def test_refcounts_stay_right_with_prefix_sharing_and_siblings():
    m = KVCacheManager(32, BS)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    for seq in ("a", "b"):  # b hits a's two full blocks
        hit = m.find_prefix(seq, prompt)
        m.allocate(seq, len(prompt), hit)
        m.commit(seq, prompt, len(prompt) - 1)
    shared = m.block_table("a")[:2]
    assert m.block_table("b")[:2] == shared
    assert [m.pool.blocks[b].ref_count for b in shared] == [2, 2]
    ta, ca = _verify_step(m, "a", prompt, len(prompt) - 1, [1, 2, 3, 4, 5, 6, 7], 2, 9)
    tb, cb = _verify_step(m, "b", prompt, len(prompt) - 1, [8, 8, 8, 8, 8, 8, 8], 0, 9)
    assert [m.pool.blocks[b].ref_count for b in shared] == [2, 2]
    assert len(m.block_table("a")) == 3 and len(m.block_table("b")) == 3
    assert m.block_table("a")[2] != m.block_table("b")[2]
    with pytest.raises(ValueError, match="shared by 2 tables"):
        m.truncate("a", 6)  # would make a shared block partial
    m.check_integrity()
    m.free("a")
    assert [m.pool.blocks[b].ref_count for b in shared] == [1, 1]
    m.free("b")
    m.check_integrity()
    assert m.num_free_blocks == 32


def test_truncate_edge_cases():
    m = KVCacheManager(8, BS)
    m.truncate("unknown", 3)  # no-op
    m.allocate("a", 8)
    m.truncate("a", 8)  # nothing past it
    assert m.block_table("a") == [0, 1]
    m.truncate("a", 0)
    assert m.block_table("a") == []
    with pytest.raises(ValueError):
        m.truncate("a", -1)
    m.check_integrity()


def test_only_accepted_kv_reaches_the_host_tier():
    """Spills (eviction write-back) and swap-outs follow hashes and the computed count: a
    sequence swapped right after a rollback moves accepted blocks only, and every host block
    that holds a name holds accepted tokens."""
    m = KVCacheManager(12, BS, num_host_blocks=16)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    m.allocate("a", len(prompt))
    m.commit("a", prompt, len(prompt) - 1)
    tokens, computed = _verify_step(m, "a", prompt, len(prompt) - 1, [1] * 8, 3, 4)
    assert computed == 10 and len(tokens) == 11 and len(m.block_table("a")) == 3
    assert m.swap_out("a", computed)
    copies = m.take_copies()
    m.complete_copies()
    assert len(copies.d2h) == 3  # blocks of positions 0..9: no block of rejected drafts
    names = set(m.host.pool.cached)
    assert names <= set(_hashes(tokens, 2))  # only full blocks of accepted tokens are named
    m.check_integrity()
    m.free("a")
    m.check_integrity()


def test_truncate_after_a_sliding_window_release():
    m = KVCacheManager(16, BS)
    tokens = list(range(30))
    m.allocate("a", 30)
    m.commit("a", tokens, 29)
    assert m.release_outside_window("a", 29, 6) == 6  # positions 0..23: blocks 0-5
    m.truncate("a", 26)  # the spec rollback cuts at the end: block 7 goes, 6 stays
    m.check_integrity()
    assert m.num_live_blocks("a") == 1 and len(m.block_table("a")) == 7
    with pytest.raises(ValueError, match="released outside the window"):
        m.truncate("a", 20)
    m.free("a")
    m.check_integrity()
    assert m.num_free_blocks == 16
