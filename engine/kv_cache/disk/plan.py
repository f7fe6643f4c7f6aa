"""Which of a prompt's blocks the disk tier reads into host memory: what memory lacks of the
longest prefix hit the three tiers together can give.

One KV group (every layer attends alike): the prompt's chain is walked while the device or the
host holds its blocks, then the run the disk holds right after them is read (a chain is useful
only up to its first gap).

A hybrid KV cache (``engine.kv_cache.groups``): every group has its own chain (its hashes salted
by the group) and its own rule for what a hit needs: a full group every block from the first, a
window group only the blocks its window still sees (``HybridKVCacheManager.needed_blocks``). A
block only the disk holds counts as one only the host holds (it will, once read), and the hit
is the manager's own (``longest_hit``): the longest ``k`` every group can resume from. The plan
reads the blocks of that hit that only the disk holds, by chain position and then group, so a
read that fails cuts the hit at the same position in every group; the manager's ``find_prefix``
then finds them in the host tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.hybrid import ON_HOST


@dataclass(frozen=True)
class ReadPlan:
    """``to_read``: the disk's blocks to read, in order; ``positions``: each one's place in
    its chain (a block of ``block_size`` prompt tokens; groups' pages of the same tokens share
    it). ``in_host``: blocks of the hit only the host holds now. ``misses``: blocks of the
    prompt's longest possible hit no tier holds."""

    to_read: list[bytes]
    positions: list[int]
    in_host: int
    misses: int


def plan_chain(kv, chain: Sequence[bytes], store: DiskStore) -> ReadPlan:
    """One group's plan (``kv``: a ``KVCacheManager`` with a host tier)."""
    cached, host = kv.pool.cached, kv.host
    i = in_host = 0
    while i < len(chain):
        if chain[i] not in cached:
            if not host.lookup(chain[i:i + 1]):
                break
            in_host += 1
        i += 1
    found = store.lookup(chain[i:]) if i < len(chain) else 0
    return ReadPlan(list(chain[i:i + found]), list(range(i, i + found)), in_host,
                    len(chain) - i - found)


def plan_groups(kv, chains: Sequence[Sequence[bytes]], store: DiskStore,
                budget: int | None = None) -> ReadPlan:
    """A hybrid cache's plan (``kv``: a ``HybridKVCacheManager`` with a host tier; ``chains``:
    its ``prompt_chains``). The store's index is refreshed (at most once a second) when blocks
    are missing: another server may have written them. ``budget``: the most blocks to read
    (the host blocks free for it); the hit is then cut to one whose reads fit -- not the first
    ``budget`` reads of the longest hit, whose window groups would hold the wrong blocks."""
    cached, host = kv.pool.cached, kv.host
    flags: list[list] = []
    on_disk: list[list[bool]] = []
    for chain in chains:
        f, d = [], []
        for h in chain:
            held = cached.get(h)
            if held is None and host.lookup((h,)):
                held = ON_HOST
            disk = held is None and h in store
            f.append(ON_HOST if disk else held)
            d.append(disk)
        flags.append(f)
        on_disk.append(d)
    num_blocks = len(chains[0]) if chains else 0
    misses = sum(flags[g][i] is None
                 for g in range(len(chains)) for i in kv.needed_blocks(num_blocks, g))
    if misses and store.refresh():
        return plan_groups(kv, chains, store, budget)

    def reads(k: int) -> list[tuple[int, int]]:
        return sorted((i, g) for g in range(len(chains)) for i in kv.needed_blocks(k, g)
                      if on_disk[g][i])

    k = kv.longest_hit(flags, num_blocks)
    if budget is not None and len(reads(k)) > budget:
        lo, hi = 0, k  # the longest cap whose hit's reads fit (binary search)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(reads(kv.longest_hit(flags, mid))) <= budget:
                lo = mid
            else:
                hi = mid - 1
        k = kv.longest_hit(flags, lo)
    todo = reads(k)
    in_host = sum(flags[g][i] is ON_HOST and not on_disk[g][i]
                  for g in range(len(chains)) for i in kv.needed_blocks(k, g))
    return ReadPlan([chains[g][i] for i, g in todo], [i for i, _ in todo], in_host, misses)
