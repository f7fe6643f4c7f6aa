"""Which running sequence gives its KV blocks back when the pool is full (the scheduler's
policy point 1): a pure choice over the running set."""

from __future__ import annotations

from collections.abc import Sequence as Seqs

from engine.request import Sequence


def pick_victim(running: Seqs[Sequence], use_priority: bool) -> Sequence:
    """The running sequence to preempt: lowest priority class first (``use_priority`` only;
    a larger ``priority`` value is lower), then the request running the most sequences, then
    its most recently admitted one (on a tie, the most recently admitted overall: LIFO, the
    least work lost). ``running`` must not be empty. O(running)."""
    cands = running
    if use_priority:
        worst = max(s.request.priority for s in cands)
        cands = [s for s in cands if s.request.priority == worst]
    count: dict[str, int] = {}
    newest: dict[str, Sequence] = {}
    for s in cands:
        rid = s.request.request_id
        count[rid] = count.get(rid, 0) + 1
        if rid not in newest or s.admit_order > newest[rid].admit_order:
            newest[rid] = s
    rid = max(count, key=lambda r: (count[r], newest[r].admit_order))
    return newest[rid]
