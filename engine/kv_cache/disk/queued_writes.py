"""``QueuedWrites``: the write side a stored tier (the disk store, the remote store) shares.

Any thread queues a block with ``submit``, which never blocks: a full queue or a tier that is
down drops it (``stats.dropped_writes``), since a block not written costs a later recompute,
not a request. The store's own writer thread takes ``(block_hash, payload)`` items off
``_queue``; a ``(None, event)`` item is a flush marker it sets when every write before it was
attempted. The class using it provides ``_queue`` (a bounded ``queue.Queue``), ``health``
(``.available``) and ``stats`` (``.dropped_writes``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class QueuedWrites:
    _queue: queue.Queue
    health: Any
    stats: Any

    def submit(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue one block for writing; False (counted as dropped) when the queue is full or
        the tier is down. Never blocks."""
        if not self.health.available:
            self.stats.dropped_writes += 1
            return False
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            self.stats.dropped_writes += 1
            return False
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write has been attempted (tests, shutdown)."""
        done = threading.Event()
        try:
            self._queue.put((None, done), timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)
