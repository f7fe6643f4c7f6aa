"""What the engine core decided in one step, per sequence, for ``Scheduler.update_from_output``.

The core samples, verifies drafts, detokenises and checks stops; it records here, per sequence,
the tokens to append, how many drafts verification kept and whether (and why) the sequence
ends. The scheduler then applies all of it in one call: it commits the chunks' K/V, appends
the tokens, rolls rejected drafts back and frees finished sequences exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request, Sequence


@dataclass
class SeqUpdate:
    """One sequence's outcome of the step."""

    # The sequence this update is for.
    seq: Sequence
    # Sampled (or kept by verification) tokens, in order, to append to seq.token_ids.
    new_token_ids: list[int] = field(default_factory=list)
    # Set for a speculating sequence once verified (None: not verified; its drafts are then
    # dropped).
    num_accepted_drafts: int | None = None
    # "stop", "length" or "abort": ends the sequence and frees its blocks (None: it goes on).
    finish_reason: str | None = None
    # The stop string or token id that ended it.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepResult:
    """Per-sequence updates of one step."""

    # The forward pass ran, so the scheduled chunks' K/V are in the cache and can be committed
    # (False when the device ran out of memory before it finished).
    kv_written: bool = False
    # By seq_id, in the order the core decided them (the scheduler frees finished sequences in
    # that order).
    updates: dict[str, SeqUpdate] = field(default_factory=dict)

    def update(self, seq: Sequence) -> SeqUpdate:
        """``seq``'s update, created empty on first use."""
        u = self.updates.get(seq.seq_id)
        if u is None:
            u = self.updates[seq.seq_id] = SeqUpdate(seq)
        return u

    def is_finished(self, seq: Sequence) -> bool:
        """Finished before this step, or ended by it."""
        u = self.updates.get(seq.seq_id)
        return seq.finished or (u is not None and u.finished)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``seq`` with ``reason`` (the first reason recorded wins)."""
        u = self.update(seq)
        if u.finish_reason is None:
            u.finish_reason, u.stop_reason = reason, stop_reason

    def abort(self, request: Request) -> None:
        """End every sequence of ``request`` ("abort") not ended yet, in this order, after
        everything recorded so far (the request failed now)."""
        for seq in request.seqs:
            u = self.updates.get(seq.seq_id)
            if u is not None and u.finished:
                continue  # ended earlier in this step: it stays where it ended
            u = self.updates.pop(seq.seq_id, None) or SeqUpdate(seq)
            self.updates[seq.seq_id] = u
            u.finish_reason, u.stop_reason = "abort", None
