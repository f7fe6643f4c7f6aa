"""The replay buffer: the last ``buffer_steps`` published batches, by sequence number, and the
answer to a replay request (vLLM's protocol).

A subscriber that saw a gap in the sequence numbers connects a DEALER (or REQ) socket to the
replay endpoint (a ROUTER) and sends ``[b"", start]`` (``start``: 8 bytes, big-endian). The
ROUTER receives ``[identity, b"", start]`` and answers, for every buffered batch whose
sequence number is ``>= start``, ``[identity, b"", seq, payload]``, then the end marker
``[identity, b"", seq(-1), b""]``: the subscriber reads ``[b"", seq, payload]`` frames until
``seq == -1``. Batches older than the buffer are gone: the first answered ``seq`` is then
larger than ``start``.
"""

from __future__ import annotations

from collections import deque

from engine.kv_events.events import END_OF_REPLAY, seq_frame


class ReplayBuffer:
    """Encoded batches ``(seq, payload)``, oldest first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._batches)

    def append(self, seq: int, payload: bytes) -> None:
        self._batches.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches with ``seq >= start``, oldest first."""
        return [(s, p) for s, p in self._batches if s >= start]

    def answer(self, request: list[bytes]) -> list[list[bytes]] | None:
        """The multipart messages a ROUTER sends back for ``request`` (its received frames);
        None for a malformed request (ignored, as vLLM does)."""
        if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
            return None
        identity, _, start = request
        first = int.from_bytes(start, "big", signed=True)
        out = [[identity, b"", seq_frame(s), p] for s, p in self.since(max(0, first))]
        out.append([identity, b"", END_OF_REPLAY, b""])
        return out
