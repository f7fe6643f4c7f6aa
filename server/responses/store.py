"""Stored responses (``store: true``), kept in memory for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

Bounded twice: at most ``max_items`` responses and ``max_bytes`` bytes (each counted as the
compact JSON of what it holds: the response object, its input items and its conversation).
When a new one would break a bound, the least recently used ones go first (a read counts as a
use); one larger than ``max_bytes`` on its own is not stored. ``max_items`` 0 stores nothing.
Lost on restart. Used from the event loop only (no locking).

A response being generated with ``store`` on is *pending* (:meth:`ResponseStore.begin`) until
:meth:`ResponseStore.put` stores it. A DELETE of a pending id succeeds and the response is then
not stored when it finishes (its own client still gets all of it). The request releases
its entry when it ends, stored or not (:meth:`ResponseStore.release`); entries are also held
weakly, so one whose request never got as far disappears with it: they are bounded by the
requests in flight.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.responses.items import size_of


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: the object as served, the request's normalised input items, and
    the conversation a successor continues (its predecessor's, then its own input and
    output items; never any ``instructions``)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return size_of([self.response, self.input_items, self.context])


class Pending:
    """The token of one response being generated (the request holds it; the store only refers
    to it weakly): ``deleted`` once a DELETE named it."""

    __slots__ = ("id", "deleted", "__weakref__")

    def __init__(self, response_id: str) -> None:
        self.id, self.deleted = response_id, False


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds cannot be negative")
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._pending: weakref.WeakValueDictionary[str, Pending] = \
            weakref.WeakValueDictionary()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    def begin(self, response_id: str) -> Pending:
        """Mark ``response_id`` as being generated; the caller keeps the token until it
        passes it to :meth:`put` or :meth:`release`."""
        pending = Pending(response_id)
        self._pending[response_id] = pending
        return pending

    def release(self, pending: Pending | None) -> None:
        """The request of ``pending`` ended (stored or not): forget it. None: nothing."""
        if pending is not None and self._pending.get(pending.id) is pending:
            del self._pending[pending.id]

    def pending_ids(self) -> list[str]:
        return list(self._pending.keys())

    def put(self, stored: StoredResponse, pending: Pending | None = None) -> bool:
        """Store ``stored`` under its response's id, evicting the least recently used as the
        bounds need; False when it is not stored (disabled, too large alone, or ``pending``,
        its token from :meth:`begin`, was deleted meanwhile)."""
        if pending is not None:
            self.release(pending)
            if pending.deleted:
                return False
        size = stored.nbytes
        if not self.enabled or size > self.max_bytes:
            return False
        key = stored.response["id"]
        self.delete(key)
        while self._items and (len(self._items) >= self.max_items
                               or self.nbytes + size > self.max_bytes):
            _, (_, old) = self._items.popitem(last=False)
            self.nbytes -= old
        self._items[key] = (stored, size)
        self.nbytes += size
        return True

    def get(self, key: str) -> StoredResponse | None:
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return entry[0]

    def delete(self, key: str) -> bool:
        """Remove a stored response, or mark a pending one deleted (it will not be stored);
        False when ``key`` is neither."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.deleted = True
        entry = self._items.pop(key, None)
        if entry is None:
            return pending is not None
        self.nbytes -= entry[1]
        return True
