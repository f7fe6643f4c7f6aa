"""Whether a client is still taking what the server writes to it (``--stream-timeout``).

uvicorn's ``send`` only waits once the transport's own buffer is full, and the kernel's send
buffer in front of it grows to megabytes: a client that stops reading (a small receive buffer,
never read) let a stream go on generating for as long as the kernel took its bytes. Here the
write side is timed where the bytes are: :meth:`WriteProgress.stalled_for` is how long the
connection has had bytes waiting (in the transport or the kernel's send queue, ``SIOCOUTQ``)
while the client acknowledged none (``TCP_INFO``'s ``tcpi_bytes_acked``). A client that reads,
however slowly, makes progress; one with nothing to read is not stalled.

Linux only (``TCP_INFO``, ``SIOCOUTQ``); elsewhere :meth:`supported` is False and only a send
that blocks is timed (server/sse.py).
"""

from __future__ import annotations

import array
import socket
import struct
import sys
import time
from typing import Any

_BYTES_ACKED_OFFSET = 120  # struct tcp_info: tcpi_bytes_acked (u64), Linux >= 4.1
_TCP_INFO_SIZE = 256


class WriteProgress:
    """One connection's write progress (event loop only). ``transport``: an asyncio transport
    over a TCP socket."""

    def __init__(self, transport: Any, clock: Any = time.monotonic) -> None:
        self.transport = transport
        self._clock = clock
        self._sock = transport.get_extra_info("socket")
        self._last_acked = -1
        self._since = clock()

    def supported(self) -> bool:
        return (sys.platform.startswith("linux") and self._sock is not None
                and self._sock.family in (socket.AF_INET, socket.AF_INET6)
                and self._read() is not None)

    def _read(self) -> tuple[int, int] | None:
        """(bytes the client acknowledged, bytes waiting to reach it), or None if unknown."""
        try:
            import fcntl
            import termios

            raw = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
            if len(raw) < _BYTES_ACKED_OFFSET + 8:
                return None
            acked = struct.unpack_from("Q", raw, _BYTES_ACKED_OFFSET)[0]
            queued = array.array("i", [0])
            fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, queued)
        except (OSError, AttributeError, ImportError, ValueError):
            return None
        return acked, queued[0] + self.transport.get_write_buffer_size()

    def stalled_for(self) -> float:
        """Seconds since the client last took a byte while bytes were waiting for it (0 when
        nothing waits or it just took some). Call it regularly: progress is seen at the calls."""
        now = self._clock()
        state = self._read()
        if state is None:
            return 0.0
        acked, waiting = state
        if waiting == 0 or acked != self._last_acked:
            self._last_acked, self._since = acked, now
        return now - self._since

    def abort(self) -> None:
        """Drop the connection and whatever waits in its buffers (the client is not reading:
        nothing more can reach it)."""
        self.transport.abort()
