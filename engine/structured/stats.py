"""``StructuredStats``: the structured-output counters in ``EngineStats`` (no torch, no
xgrammar: the server's metrics read it)."""

from __future__ import annotations

from dataclasses import dataclass

# Upper bounds (seconds) of the compile-time histogram's buckets; the last is +inf.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class StructuredStats:
    compiles: int = 0
    compile_failures: int = 0
    cache_hits: int = 0
    compile_seconds_sum: float = 0.0
    compile_buckets: tuple[int, ...] = (0,) * (len(COMPILE_BUCKETS) + 1)
    constrained_rows: int = 0  # sampled rows that carried a grammar, cumulative
    constrained_steps: int = 0  # steps with at least one such row
    jump_forward_drafted: int = 0  # forced tokens proposed as drafts (jump_forward.py)
    jump_forward_accepted: int = 0  # of them kept by verification
    # Constrained rows whose logits the head computed at the allowed tokens only
    # (engine/runner/logit_columns.py), cumulative.
    restricted_rows: int = 0
    # The bounds on one constraint's cost (engine.structured.cache, mask_filler, vet_worker):
    refused_at_once: int = 0  # submits refused from memory: the constraint was refused before
    compile_queue_full: int = 0  # constraints turned away: too many waited to be compiled
    mask_failures: int = 0  # requests ended while running by their constraint's mask
    mask_timeouts: int = 0  # of them: a row's mask fill ran past its deadline
    vet_worker_kills: int = 0  # vetting child processes killed at the deadline or found dead
