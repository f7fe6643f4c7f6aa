"""``CompileQueue``: the constraints waiting to be vetted and compiled, served fairly by client.

One worker vets constraints one at a time, and a hostile constraint may hold it up to its
deadline; with one queue in arrival order, one client sending many such constraints would make
every other client wait behind all of them. So each client (the server passes the peer's
address; the engine's own submissions have none) has its own queue, and the worker takes the
next constraint of the client it served least recently (one it never served first): a client
that sends one constraint waits behind at most the one already running. At most ``max_items`` constraints wait or run in all, and at
most ``max_per_client`` of one client: one more is a ``CompileQueueFullError`` (a 503 with
``Retry-After``) for that client only, unless the caller is the engine itself (``bounded=False``:
what it submits was admitted already). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")
MAX_CLIENTS = 4096  # clients whose last turn is remembered


class CompileQueueFullError(RuntimeError):
    """Too many constraints wait to be compiled, in all or from this client (a 503)."""


class CompileQueue(Generic[T]):
    def __init__(self, max_items: int, max_per_client: int) -> None:
        if max_items < 1 or max_per_client < 1:
            raise ValueError("the compile queue's bounds must be at least 1")
        self.max_items, self.max_per_client = max_items, max_per_client
        self._cond = threading.Condition()
        self._queues: dict[str, deque[T]] = {}
        self._held: Counter[str] = Counter()  # per client: waiting or running
        # per client: when last served (a count of gets); the most recent MAX_CLIENTS kept
        self._served: OrderedDict[str, int] = OrderedDict()
        self._gets = 0
        self._closed = False

    def put(self, client: str, item: T, bounded: bool = True) -> None:
        with self._cond:
            if bounded:
                total = sum(self._held.values())
                if total >= self.max_items:
                    raise CompileQueueFullError(
                        f"{total} structured-output constraints are waiting to be compiled; "
                        f"retry shortly")
                if self._held[client] >= self.max_per_client:
                    raise CompileQueueFullError(
                        f"this client has {self._held[client]} structured-output constraints "
                        f"waiting to be compiled; retry when they are done")
            self._held[client] += 1
            self._queues.setdefault(client, deque()).append(item)
            self._cond.notify()

    def get(self) -> tuple[str, T] | None:
        """The next ``(client, item)``: the oldest item of the client served least recently;
        blocks; None once closed."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            client = min(self._queues, key=lambda c: self._served.get(c, -1))
            items = self._queues[client]
            item = items.popleft()
            if not items:
                del self._queues[client]
            self._gets += 1
            self._served[client] = self._gets
            self._served.move_to_end(client)
            while len(self._served) > MAX_CLIENTS:
                self._served.popitem(last=False)
            return client, item

    def done(self, client: str) -> None:
        """``client``'s item taken by ``get`` has finished: its place is free."""
        with self._cond:
            self._held[client] -= 1
            if self._held[client] <= 0:
                del self._held[client]

    def drain(self) -> list[T]:
        """Close the queue and return what still waited (never taken by ``get``)."""
        with self._cond:
            self._closed = True
            left = [item for items in self._queues.values() for item in items]
            self._queues.clear()
            self._cond.notify_all()
            return left
