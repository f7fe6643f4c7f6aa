"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, then
``data: [DONE]\\n\\n``. JSON is compact and never holds NaN/Infinity (invalid JSON). Text is
UTF-8 as it is, except U+0085, U+2028 and U+2029, which are written as JSON escapes: Python's
``str.splitlines`` (and so ``httpx``'s ``iter_lines``, which many clients read streams with)
ends a line at each of them, and a model may sample them (the same JSON value either way).

:class:`SSEResponse` bounds what a client that stops reading can cost: when for
``send_timeout`` seconds the client has taken no byte while bytes wait for it (in the kernel's
send buffer too: server/write_progress.py, given by server/connections.py), or a send cannot
complete for that long, the response ends and its connection is dropped; ``on_close`` (the
endpoint's "abort my engine requests", which frees their KV blocks) runs exactly once however
the response ends — including a client that went away before the body's first byte, when the
body iterator never even starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

logger = logging.getLogger("kvserve.server")
_timeout = getattr(asyncio, "timeout", None)

DONE = "data: [DONE]\n\n"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


# Line ends to str.splitlines that JSON leaves raw (it escapes those below U+0020 itself); only
# ever inside JSON strings, so their escapes are the same value.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """Compact JSON of ``obj``, one line to every line splitter (see the module docstring)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.translate(_LINE_BREAKERS)


def event(obj: Any) -> str:
    """One SSE event carrying ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


class SendTimeoutError(Exception):
    """The client did not take a chunk of the stream within the send timeout."""


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response over ``chunks``; see the module docstring."""

    def __init__(self, chunks: AsyncIterator[str], *, headers: dict[str, str] | None = None,
                 send_timeout: float | None = None, on_close: Callable[[], None] | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={**SSE_HEADERS, **(headers or {})})
        self.send_timeout = send_timeout
        self.on_close = on_close
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.send_timeout
        closed = False

        def close_once() -> None:
            nonlocal closed
            if not closed and self.on_close is not None:
                closed = True
                self.on_close()

        progress = (scope.get("extensions") or {}).get("kvserve.write_progress")
        watchdog = None
        if timeout and progress is not None and progress.supported():
            watchdog = asyncio.create_task(self._watch(progress, timeout, close_once))

        async def timed_send(message: Message) -> None:
            # uvicorn's send waits while the socket's write buffer is full: a client that stops
            # reading blocks it here, with the engine request (and its KV blocks) held.
            try:
                if _timeout is not None:  # Python >= 3.11: no task per chunk
                    async with _timeout(timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                raise SendTimeoutError from None

        try:
            await super().__call__(scope, receive, timed_send if timeout else send)
        except SendTimeoutError:
            # Returning without completing the response makes the server close the connection.
            logger.warning("request_id=%s the client read nothing for %gs: stream aborted",
                           self.request_id, timeout)
        except ClientDisconnect:  # ASGI 2.4 servers: send raises once the client is gone
            pass
        finally:
            if watchdog is not None:
                watchdog.cancel()
            close_once()
            # Run the body iterator's own cleanup now rather than whenever it is collected.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watch(self, progress: Any, timeout: float, close: Callable[[], None]) -> None:
        """End the stream once the client has taken nothing for ``timeout`` seconds while
        bytes waited for it: the engine requests are aborted now, the connection dropped."""
        interval = min(1.0, timeout / 4)
        while True:
            await asyncio.sleep(interval)
            if progress.stalled_for() >= timeout:
                break
        logger.warning("request_id=%s the client read nothing for %gs: stream aborted",
                       self.request_id, timeout)
        close()
        progress.abort()

