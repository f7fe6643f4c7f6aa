"""Streaming past the context (StreamingLLM's attention sinks, ``--kv-eviction sink:S,window:N``).

A sequence keeps the KV of its first ``S`` tokens (the sinks) and of its most recent ``N``; the
blocks in between are evicted as it grows, so a generation can go past ``max_model_len`` in
bounded memory (approximate by design: kept keys were computed with context the model no longer
sees). A key's rotary position is its index in the kept cache; K is stored after RoPE, so
evicting ``d`` tokens re-rotates every kept key behind them by ``-d`` (llama.cpp's K-shift): the
scheduler records it (``engine.step.plan.KeyShift``), the model runner applies it before the
step's copies and forward pass (``engine.kv_format.rope_shift``).

Granularity is the block (``S``, ``N`` rounded up; every shift a multiple of ``block_size``).
With ``E`` tokens evicted, text position ``t`` past the gap lives at cache position ``t - E``.
Eviction starts once the prompt is computed. A recompute-preempted sequence keeps its gap and
recomputes only the kept tokens. The engine runs without prefix caching and sibling block
sharing under this policy (re-rotated blocks no longer match their hash and must be private)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config.kv_eviction import KVEvictionSpec
from engine.kv_cache.manager import KVCacheManager
from engine.step.plan import KeyShift

if TYPE_CHECKING:
    from engine.request import Sequence


@dataclass
class StreamingEviction:
    """The scheduler's policy object: per sequence, how many middle tokens were evicted, and
    the key shifts recorded since the plan last took them. Text positions (the
    ``Sequence``'s ``num_computed_tokens``) stay text positions; the KV manager and the step
    plan see cache positions (:meth:`cache_pos`)."""

    spec: KVEvictionSpec
    kv: KVCacheManager
    num_evicted_blocks: int = 0  # cumulative, all sequences
    _evicted: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens evicted
    _shifts: list[KeyShift] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_size = self.kv.block_size
        self.sink_blocks, self.window_blocks = self.spec.blocks(self.block_size)
        self.sink_tokens = self.sink_blocks * self.block_size

    def num_evicted_tokens(self, seq_id: str) -> int:
        return self._evicted.get(seq_id, 0)

    def cache_pos(self, seq_id: str, text_pos: int) -> int:
        """Where text position ``text_pos`` (not inside the gap) sits in the cache."""
        e = self.num_evicted_tokens(seq_id)
        return text_pos - e if e and text_pos > self.sink_tokens else text_pos

    def resume_point(self, seq_id: str, computed: int) -> int:
        """Text tokens computed, with a recomputation that has just redone the sinks jumping
        over the gap (the evicted tokens are not recomputed)."""
        e = self.num_evicted_tokens(seq_id)
        return computed + e if e and computed == self.sink_tokens else computed

    def chunk_limit(self, seq_id: str, computed: int, num_new: int) -> int:
        """``num_new`` cut so that a chunk never crosses the gap (recomputing the sinks)."""
        if self._evicted.get(seq_id) and computed < self.sink_tokens:
            return min(num_new, self.sink_tokens - computed)
        return num_new

    def evict(self, seq_id: str, computed: int, prompt_done: bool) -> int:
        """Before a running sequence's next chunk: evict the middle blocks beyond sinks and
        window (the oldest full blocks after the sinks; the window keeps ``window_blocks``
        full blocks plus the one being filled) and record the shift of the kept ones behind
        them. ``computed`` is in text positions. Returns the blocks evicted now."""
        if not prompt_done:
            return 0
        e = self.num_evicted_tokens(seq_id)
        cached = computed - e
        n = cached // self.block_size - self.sink_blocks - self.window_blocks
        if n <= 0:
            return 0
        moved = self.kv.evict_middle(seq_id, self.sink_blocks, n)
        delta = n * self.block_size
        self._evicted[seq_id] = e + delta
        if moved:
            self._shifts.append(KeyShift(delta, tuple(moved)))
        self.num_evicted_blocks += n
        return n

    def before_chunk(self, seq: Sequence) -> None:
        """Before a running sequence's chunk: a recomputation that has redone the sinks jumps
        the gap; then the middle blocks past sinks + window are evicted."""
        seq.num_computed_tokens = self.resume_point(seq.seq_id, seq.num_computed_tokens)
        self.evict(seq.seq_id, seq.num_computed_tokens,
                   seq.num_computed_tokens >= seq.num_prompt_tokens)

    def take_shifts(self) -> tuple[KeyShift, ...]:
        """The shifts recorded since the last call, for the step plan (once)."""
        shifts, self._shifts = tuple(self._shifts), []
        return shifts

    def forget(self, seq_id: str) -> None:
        """``seq_id`` ended: drop its record (its blocks are freed by the KV manager)."""
        self._evicted.pop(seq_id, None)
