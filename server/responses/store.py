"""Stored responses (``store: true``), kept in memory for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

Bounded twice: at most ``max_items`` responses and ``max_bytes`` bytes (each counted as the
compact JSON of what it holds: the response object, its input items and its conversation).
When a new one would break a bound, the least recently used ones go first (a read counts as a
use); one larger than ``max_bytes`` on its own is not stored. ``max_items`` 0 stores nothing.
Lost on restart. Used from the event loop only (no locking).
"""

from __future__ import annotations

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


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds cannot be negative")
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_items > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> bool:
        """Store ``stored`` under its response's id, evicting the least recently used as the
        bounds need; False when it is not stored (disabled, or too large alone)."""
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
        entry = self._items.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry[1]
        return True
