"""The last bound on ``kvserve serve``'s exit: once the drain's budget and a grace are spent, the
process ends even if something it would wait for does not (a library call that never returns, a
thread pool joined at interpreter exit, a child process that ignores its pipe).

``arm(seconds, status)`` starts, once per process, a daemon thread that sleeps ``seconds``, logs
one line naming the threads still alive and calls ``os._exit(status())``. server/graceful.py
arms it when the drain begins, with ``shutdown_timeout + CUT_GRACE + EXIT_GRACE``: SIGTERM always
ends the process within ``--shutdown-timeout`` plus a few seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvserve.cli")

EXIT_GRACE = 3.0  # seconds after the drain and its cut grace for the interpreter's own exit

_armed = threading.Lock()


def arm(seconds: float, status: Callable[[], int]) -> bool:
    """Start the watchdog (a no-op after the first call); True when this call started it."""
    if not _armed.acquire(blocking=False):
        return False

    def watch() -> None:
        time.sleep(seconds)
        alive = sorted(t.name for t in threading.enumerate()
                       if t is not threading.current_thread() and t.is_alive())
        code = status()
        logger.error("exit took longer than the shutdown budget (%.1fs); ending the process now "
                     "(status %d; threads still alive: %s)", seconds, code,
                     ", ".join(alive) or "none")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    threading.Thread(target=watch, name="kvserve-exit-watchdog", daemon=True).start()
    return True
