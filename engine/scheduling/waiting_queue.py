"""The scheduler's waiting queue: sequences in (priority, arrival, sample index) order.

A binary heap with lazy deletion: ``push`` and ``pop`` cost O(log n), ``remove`` (an abort of
a waiting sequence) O(1) — its heap entry is only marked dead and skipped when it surfaces;
the heap is rebuilt when dead entries outnumber live ones, so memory stays O(live). ``peek``
is amortised O(log n). Iteration (introspection, tests) is O(n) and in no particular order.

With ``use_priority=False`` (``scheduling_policy="fcfs"``) a request's ``priority`` is ignored:
the order is arrival order, then sample index.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from engine.request import Sequence


class WaitingQueue:
    """Ordered set of waiting sequences; a sequence is in it at most once."""

    def __init__(self, use_priority: bool = True) -> None:
        self.use_priority = use_priority
        self._heap: list[list] = []  # [key, tie, seq, alive]
        self._entries: dict[Sequence, list] = {}  # live sequence -> its heap entry
        self._per_request: dict[str, int] = {}  # request id -> live sequences queued
        self._tie = itertools.count()

    def key(self, seq: Sequence) -> tuple[int, int, int]:
        prio = seq.request.priority if self.use_priority else 0
        return (prio, seq.request.arrival_order, seq.index)

    def push(self, seq: Sequence) -> None:
        if seq in self._entries:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        entry = [self.key(seq), next(self._tie), seq, True]
        self._entries[seq] = entry
        rid = seq.request.request_id
        self._per_request[rid] = self._per_request.get(rid, 0) + 1
        heapq.heappush(self._heap, entry)

    def peek(self) -> Sequence | None:
        """The first sequence in order, or None when empty."""
        heap = self._heap
        while heap and not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self._forget(seq)
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out; False if it was not waiting."""
        entry = self._entries.get(seq)
        if entry is None:
            return False
        entry[3] = False
        self._forget(seq)
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [e for e in self._heap if e[3]]
            heapq.heapify(self._heap)
        return True

    def _forget(self, seq: Sequence) -> None:
        del self._entries[seq]
        rid = seq.request.request_id
        left = self._per_request[rid] - 1
        if left:
            self._per_request[rid] = left
        else:
            del self._per_request[rid]

    def __contains__(self, seq: object) -> bool:
        return seq in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._entries))

    @property
    def num_requests(self) -> int:
        """How many distinct requests have a sequence in the queue (O(1))."""
        return len(self._per_request)
