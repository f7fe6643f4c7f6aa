"""Whether the disk tier may write now, why not, and when to try again.

The tier is an optional cache: a directory that cannot be used costs the cache only, never the
server. :class:`DiskHealth` is the state machine: **ok** (writing; the first failure moves to
*down* and logs one WARNING naming the directory and the OS's reason); **down** (writes dropped
and counted; a retry is due ``delay_s`` after the last failure, doubling from
``RetryPolicy.first_s`` up to ``max_s``); **probation** (a retry found the directory usable;
writes go on, but a failure now is the same outage: no second WARNING, the delay doubles; the
first successful write logs the recovery once and starts the backoff over).

Every failure counts in ``errors``. The state is changed by one thread at a time (the store's
constructor, then its writer thread); other threads only read ``available`` and ``full``."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvserve.engine")

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
OK, DOWN, PROBATION = "ok", "down", "probation"


@dataclass(frozen=True)
class RetryPolicy:
    """Retry delays after a failure: ``first_s``, doubling, at most ``max_s`` seconds."""

    first_s: float = 1.0
    max_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.first_s > 0:
            raise ValueError(f"the disk tier's first retry delay must be > 0 s; got "
                             f"{self.first_s}")
        if self.max_s < self.first_s:
            raise ValueError(f"the disk tier's longest retry delay ({self.max_s} s) is below "
                             f"its first ({self.first_s} s)")


def describe_error(exc: OSError) -> str:
    """The OS's words for ``exc`` (``No space left on device``), else its text."""
    return exc.strerror or str(exc) or type(exc).__name__


class DiskHealth:
    def __init__(self, directory: Path, policy: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``directory``: named in the log lines. ``clock``: seconds, monotonic (tests pass a
        fake one they advance)."""
        self.directory = directory
        self.policy = policy
        self.clock = clock
        self.state = OK
        self.reason = ""  # the last failure's, while not ok
        self.full = False  # down because the disk (or a quota) is full
        self.errors = 0
        self.delay_s = policy.first_s
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        """Writes are attempted (ok, or on probation after a retry)."""
        return self.state != DOWN

    def failed(self, what: str, exc: OSError) -> None:
        """``what`` (e.g. ``writing a block``) failed with ``exc``: down until the next retry."""
        self.errors += 1
        if self.state == PROBATION:
            self.delay_s = min(self.delay_s * 2, self.policy.max_s)
        elif self.state == DOWN and self._retry_at <= self.clock():
            self.delay_s = min(self.delay_s * 2, self.policy.max_s)  # a failed retry
        self.reason = describe_error(exc)
        self.full = exc.errno in FULL_ERRNOS
        self._retry_at = self.clock() + self.delay_s
        if self.state == OK:
            kind = "the disk is full" if self.full else f"{what} failed"
            logger.warning("kv disk tier: %s in %s (%s): serving without writing to the disk "
                           "tier (reads of what it holds go on); retrying in %.0f s, backing "
                           "off to %.0f s", kind, self.directory, self.reason, self.delay_s,
                           self.policy.max_s)
        else:
            logger.debug("kv disk tier: %s in %s failed again (%s); next retry in %.0f s",
                         what, self.directory, self.reason, self.delay_s)
        self.state = DOWN

    def retry_due(self) -> bool:
        return self.state == DOWN and self.clock() >= self._retry_at

    def seconds_to_retry(self) -> float:
        """Seconds until a retry is due (0 when due or not down)."""
        return max(0.0, self._retry_at - self.clock()) if self.state == DOWN else 0.0

    def usable(self) -> None:
        """A retry found the directory usable: writes resume, on probation."""
        if self.state == DOWN:
            self.state = PROBATION
            self.full = False

    def wrote(self) -> None:
        """A write succeeded (cheap when ok: called for every block)."""
        if self.state == PROBATION:
            logger.info("kv disk tier: %s is writable again (after %s): writing resumes",
                        self.directory, self.reason)
            self.state, self.reason, self.delay_s = OK, "", self.policy.first_s
