"""Whether the remote store is used now, why not, and when to try again.

The remote tier is a cache: a server that is down, unreachable or slow costs misses and dropped
writes, never a failed or stalled request. The state machine is the disk tier's
(``engine.kv_cache.disk.health``, its ``RetryPolicy`` included): **ok** (traffic goes to the
server; the first failure moves to *down* with one WARNING); **down** (nothing is sent: misses,
dropped writes; the writer pings ``delay_s`` after the last failure, doubling up to ``max_s``);
**probation** (a ping answered; traffic resumes, a failure now is the same outage; the first
command that succeeds logs the recovery once).

Unlike the disk's, this state is changed from three threads (the engine thread's look-ups, the
reader's reads, the writer's writes and pings): every change holds a lock."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.kv_cache.disk.health import DOWN, OK, PROBATION, RetryPolicy

logger = logging.getLogger("kvserve.engine")


class RemoteHealth:
    def __init__(self, where: str, policy: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``where``: the server as the log names it (no password)."""
        self.where = where
        self.policy = policy
        self.clock = clock
        self.state = OK
        self.reason = ""
        self.errors = 0
        self.outages = 0
        self.delay_s = policy.first_s
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        """Commands are sent (ok, or on probation after a ping answered)."""
        return self.state != DOWN

    def failed(self, what: str, exc: BaseException) -> None:
        """``what`` (e.g. ``looking blocks up``) failed with ``exc``: down until a retry."""
        with self._lock:
            self.errors += 1
            if self.state == DOWN and self._retry_at > self.clock():
                return  # another thread's command of the same outage, sent before it began
            if self.state != OK:
                self.delay_s = min(self.delay_s * 2, self.policy.max_s)
            first = self.state == OK
            self.reason = f"{type(exc).__name__}: {exc}"[:200]
            self._retry_at = self.clock() + self.delay_s
            self.state = DOWN
            if first:
                self.outages += 1
        if first:
            logger.warning("kv remote tier: %s at %s failed (%s): serving without it (blocks "
                           "are recomputed, writes dropped); retrying in %.3g s, backing off to "
                           "%.3g s", what, self.where, self.reason, self.delay_s,
                           self.policy.max_s)
        else:
            logger.debug("kv remote tier: %s at %s failed again (%s); next retry in %.3g s",
                         what, self.where, self.reason, self.delay_s)

    def retry_due(self) -> bool:
        return self.state == DOWN and self.clock() >= self._retry_at

    def seconds_to_retry(self) -> float:
        """Seconds until a retry is due (0 when due or not down)."""
        return max(0.0, self._retry_at - self.clock()) if self.state == DOWN else 0.0

    def usable(self) -> None:
        """A ping answered: commands resume, on probation."""
        with self._lock:
            if self.state == DOWN:
                self.state = PROBATION

    def succeeded(self) -> None:
        """A command succeeded (cheap when ok: called for every one)."""
        if self.state != PROBATION:
            return
        with self._lock:
            if self.state != PROBATION:
                return
            self.state, reason, self.reason = OK, self.reason, ""
            self.delay_s = self.policy.first_s
        logger.info("kv remote tier: %s answers again (after %s): the tier resumes",
                    self.where, reason)
