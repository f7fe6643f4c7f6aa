"""``quantization=auto``'s kernel settings measured after the server is ready (``--cpu-probe
background``, ``kvserve serve``'s default): serve first, tune later.

Where a machine has no cached verdict for a model, it loads with each setting's default
(:attr:`Verdict.pending`) and :class:`BackgroundProbe` runs ``probe.measure_settings`` in turns
the idle engine gives it. The contract:

- on the engine's own thread: the probe is a greenlet the engine thread switches into and that
  switches back before its next timed pass once :data:`TURN_S` has passed (its OpenMP regions
  cost what a step's do: a second thread's each cost ~25 us more, docs/decisions.md); a request
  that arrives waits for at most that pass;
- the modules serve as they were loaded: :meth:`BackgroundProbe.suspend` (called before any
  step) puts back every module's serving kernels, and the next turn restores the probe's;
- the verdict is switched in only when no request is unfinished (:meth:`BackgroundProbe.switch`),
  so no request runs on two kernel sets (under batch invariance the alternatives compute the
  same floats; without it a later request may differ in its last bits);
- bounded: after :data:`LIMIT_S` of turns the defaults stay and nothing is cached (the next
  start measures again); progress logged per measured setting, with an ETA;
- a verdict whose runs agreed is cached under :attr:`Verdict.pending`'s key, as a start-up
  probe's is.
"""

from __future__ import annotations

import logging
import time

import greenlet

from engine.quantization import probe_cache
from engine.quantization.kernel_choice import KernelChoice
from engine.quantization.linear import QuantisedModules
from engine.quantization.probe import (
    apply_settings,
    checkpoints,
    leaf_modules,
    measure_settings,
    planned_settings,
)
from engine.quantization.verdict import Setting, Verdict

logger = logging.getLogger("kvserve.engine")

TURN_S = 0.05  # a turn ends at the first timed pass after this long
LIMIT_S = 600.0  # turns in all, then the defaults stay (not cached)


class _Abandoned(Exception):
    """Raised inside the probe to end it (the limit, or the engine closing)."""


class BackgroundProbe:
    """The pending measurement of one model's quantised modules (the module docstring)."""

    def __init__(self, quantised: QuantisedModules, key: str, limit_s: float = LIMIT_S,
                 turn_s: float = TURN_S) -> None:
        self._q = quantised
        self._leaves = leaf_modules(quantised)
        self.key = key
        self.limit_s, self.turn_s = limit_s, turn_s
        self._serving: list | None = None  # read at the first turn: the model as it serves
        # The start-up probe's starting point: fresh modules' kernels, not batch-invariant.
        self._probing = [(KernelChoice(), False) for _ in self._leaves]
        self._in_probe_state = False
        self._glet: greenlet.greenlet | None = None
        self._turn_start = 0.0
        self._stop = False
        self.spent_s = 0.0
        self.planned = max(planned_settings(quantised), 1)
        self.measured: list[Setting] = []
        self.verdict: Verdict | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.switched = False

    # ---- the engine's side ---------------------------------------------------------------

    def run_turn(self) -> None:
        """Give the probe one turn (the engine is idle): returns when it hands the turn back
        or ends. Nothing to do once :attr:`finished`."""
        if self.finished:
            return
        if self._serving is None:
            self._serving = self._state()
        if not self._in_probe_state:
            self._set_state(self._probing)
            self._in_probe_state = True
        if self._glet is None:
            logger.info("start-up probe (background): measuring %d kernel settings on idle "
                        "steps, the default kernels serving meanwhile (at most %.0f s of "
                        "probing; --cpu-probe cached measures before the ready line instead)",
                        self.planned, self.limit_s)
            self._glet = greenlet.greenlet(self._main)
        self._turn_start = time.perf_counter()
        self._glet.switch()
        self.spent_s += time.perf_counter() - self._turn_start
        if self.finished:
            self.suspend()

    def idle_turn(self, on_switch) -> bool:
        """:meth:`run_turn`, then once finished :meth:`switch`, calling ``on_switch()`` when the
        modules changed; True while turns remain."""
        self.run_turn()
        if not self.finished:
            return True
        if self.switch():
            on_switch()
        return False

    def suspend(self) -> None:
        """Put the modules' serving kernels back (before any step); the probe's own are kept
        for its next turn."""
        if self._in_probe_state:
            self._probing = self._state()
            self._set_state(self._serving)
            self._in_probe_state = False

    def switch(self) -> bool:
        """Once :attr:`finished` with a verdict and not yet switched: serve it (call only
        with no request unfinished), cache it if its runs agreed, log it; True when the
        modules changed (the caller rebuilds what holds their weights: the decode stack)."""
        if not self.finished or self.switched:
            return False
        self.switched = True
        if self.verdict is None:
            logger.warning("start-up probe (background): %s after %.1f s; the default kernels "
                           "stay, the next start measures again", self._why_none(),
                           self.spent_s)
            return False
        apply_settings(self._q, self.verdict)  # keeps each module's activation precision
        for m, (_, invariant) in zip(self._leaves, self._serving or self._state()):
            if invariant:
                m.set_batch_invariant()
        self._serving = self._state()
        cached = self.verdict.confirmed
        if cached:
            probe_cache.save(self.key, self.verdict.to_dict())
        logger.info("start-up probe (background): done in %.1f s of idle time, switched to "
                    "the measured kernels between requests (%s; %s)", self.spent_s,
                    self.verdict.describe() or "defaults",
                    "cached for later starts" if cached else
                    "runs disagreed (a busy machine): not cached, the next start measures again")
        return True

    def close(self) -> None:
        """End the probe (the engine is closing); the modules serve as loaded."""
        if self._glet is None or self.finished:
            return
        self._stop = True
        try:
            self.run_turn()
        except greenlet.error:  # closed from another thread than its engine's: left as it is
            self.finished = True

    # ---- the probe's side (inside the greenlet) -----------------------------------------

    def _main(self) -> None:
        try:
            with checkpoints(self._checkpoint):
                settings = measure_settings(self._q, on_setting=self._progress)
            self.verdict = Verdict("quant", None, {}, settings)
        except BaseException as exc:  # noqa: BLE001 - reported by switch(), serving goes on
            self.error = exc
        finally:
            self.finished = True

    def _checkpoint(self) -> None:
        spent = time.perf_counter() - self._turn_start
        if self._stop or self.spent_s + spent > self.limit_s:
            raise _Abandoned()
        if spent < self.turn_s:
            return
        self._glet.parent.switch()  # the engine's turn; back here at the probe's next
        if self._stop:
            raise _Abandoned()

    def _progress(self, setting: Setting) -> None:
        self.measured.append(setting)
        spent = self.spent_s + (time.perf_counter() - self._turn_start)
        done = len(self.measured)
        left = max(self.planned - done, 0) * spent / done
        logger.info("start-up probe (background): %s (%d/%d, %.1f s, ~%.0f s left)",
                    setting.describe(), done, self.planned, spent, left)

    def _state(self) -> list:
        return [(m.kernels, m.batch_invariant) for m in self._leaves]

    def _set_state(self, state: list) -> None:
        for m, (kernels, invariant) in zip(self._leaves, state):
            m.set_kernels(kernels)
            m.batch_invariant = invariant

    def _why_none(self) -> str:
        if isinstance(self.error, _Abandoned):
            return "stopped" if self._stop else f"over its {self.limit_s:.0f} s limit"
        return f"failed ({type(self.error).__name__}: {self.error})"
