"""Which blocks the disk tier reads for a hybrid KV cache (engine/kv_cache/disk/plan.py): each
group's own chain, a window group only its window's blocks, by chain position; a gap on disk
cuts the hit where the hybrid manager's own prefix rule would; memory's blocks are not read."""

from __future__ import annotations

from engine.kv_cache.disk.plan import plan_chain, plan_groups
from engine.kv_cache.groups import KVCacheGroupSpec, KVGroupLayout
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.kv_cache.manager import KVCacheManager

BS = 4
WINDOW = 8
TOKENS = list(range(100, 141))  # 41 tokens: a hit of at most 10 blocks


class _Store:
    """The disk store's look-up surface: a set of hashes."""

    def __init__(self, hashes=()):
        self.hashes = set(hashes)
        self.refreshes = 0

    def __contains__(self, h):
        return h in self.hashes

    def lookup(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n

    def refresh(self, force=False):
        self.refreshes += 1
        return False


def _hybrid() -> HybridKVCacheManager:
    layout = KVGroupLayout((KVCacheGroupSpec((0,), None), KVCacheGroupSpec((1,), WINDOW)),
                           (0, 1), (0, 0))
    return HybridKVCacheManager(64, BS, layout, num_host_blocks=16)


def test_a_whole_disk_hit_reads_the_full_chain_and_the_window_only():
    kv = _hybrid()
    full, win = kv.prompt_chains(TOKENS)
    assert len(full) == len(win) == 10 and not set(full) & set(win)  # salted per group
    plan = plan_groups(kv, (full, win), _Store(full + win))
    # the window group at position 40 sees tokens 33..40: blocks 8 and 9
    expect = full[:8] + [full[8], win[8], full[9], win[9]]
    assert plan.to_read == expect and plan.in_host == 0 and plan.misses == 0


def test_a_gap_on_disk_cuts_the_hit_as_find_prefix_would():
    kv = _hybrid()
    full, win = kv.prompt_chains(TOKENS)
    store = _Store(full + win[:9])  # the window group's last block is missing
    plan = plan_groups(kv, (full, win), store)
    # 9 blocks: the window group then needs blocks 7 and 8 (tokens 29..36)
    assert plan.to_read == full[:7] + [full[7], win[7], full[8], win[8]]
    assert plan.misses == 1 and store.refreshes == 1  # missing: the index looked at again
    plan = plan_groups(kv, (full, win), _Store(win))  # the full group has nothing on disk
    assert plan.to_read == [] and plan.misses == 10  # the window group's are there


def test_blocks_memory_holds_are_not_read():
    kv = _hybrid()
    kv.allocate("a", 12)  # 3 blocks in every group, committed: on the device, named
    kv.commit("a", TOKENS, 12)
    full, win = kv.prompt_chains(TOKENS)
    plan = plan_groups(kv, (full, win), _Store(full + win))
    assert plan.to_read == full[3:8] + [full[8], win[8], full[9], win[9]]
    assert kv.find_prefix("b", TOKENS).num_tokens == 12  # what memory alone gives


def test_one_group_reads_the_run_after_memory():
    kv = KVCacheManager(64, BS, num_host_blocks=16)
    (chain,) = kv.prompt_chains(TOKENS)
    kv.find_prefix("a", TOKENS, record_stats=False)
    assert kv.block_hashes("a") == chain  # what find_prefix looks up
    plan = plan_chain(kv, chain, _Store(chain[2:6]))
    assert plan.to_read == [] and plan.misses == 10  # the disk's run does not start at 0
    plan = plan_chain(kv, chain, _Store(chain[:6]))
    assert plan.to_read == chain[:6] and plan.misses == 4


def test_a_budget_cuts_the_hit_to_reads_that_fit():
    """Room for 5 host blocks: not the longest hit's first 5 reads (its window group would get
    none of the blocks it needs) but the hit of 3 blocks, whose window needs blocks 1 and 2."""
    kv = _hybrid()
    full, win = kv.prompt_chains(TOKENS)
    plan = plan_groups(kv, (full, win), _Store(full + win), budget=5)
    assert plan.to_read == [full[0], full[1], win[1], full[2], win[2]]
    assert plan.positions == [0, 1, 1, 2, 2]
    assert plan_groups(kv, (full, win), _Store(full + win), budget=1).to_read == []
