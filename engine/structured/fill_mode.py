"""Whether a constrained step fills its bitmasks during the forward pass or before it, chosen by
measurement.

Filling on a worker thread while the forward pass runs hides a cheap fill entirely (a JSON
schema's masks), but a costly one (xgrammar on a bounded regex repetition) then competes with
the forward pass for the same cores, and on two cores that is slower than filling first
(docs/decisions.md#grammar-libraries). Which
wins depends on the grammar, the batch and the machine, so ``FillModeChooser`` times constrained
steps (wall time from the fill's start to the masked logits, per sampled row) in both modes,
alternating for ``trial`` steps each, keeps the mode with the lower median for ``hold`` steps,
then measures again.
"""

from __future__ import annotations

import statistics


class FillModeChooser:
    def __init__(self, trial: int = 4, hold: int = 256) -> None:
        if trial < 1 or hold < 1:
            raise ValueError("trial and hold must be at least 1")
        self.trial, self.hold = trial, hold
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._held = 0
        self.chosen: bool | None = None  # None while measuring

    def overlap(self) -> bool:
        """The mode for the next constrained step: True = fill during the forward pass."""
        if self.chosen is not None:
            return self.chosen
        return len(self._times[True]) <= len(self._times[False])  # alternate, overlap first

    def record(self, overlap: bool, seconds: float, rows: int) -> None:
        """One constrained step took ``seconds`` for ``rows`` sampled rows in mode ``overlap``."""
        if self.chosen is not None:
            self._held += 1
            if self._held >= self.hold:  # measure again
                self.chosen, self._held = None, 0
                self._times = {True: [], False: []}
            return
        self._times[overlap].append(seconds / max(rows, 1))
        if min(len(t) for t in self._times.values()) >= self.trial:
            on, off = (statistics.median(self._times[m]) for m in (True, False))
            self.chosen = on <= off
