"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, then
``data: [DONE]\\n\\n``. JSON is compact and never holds NaN/Infinity (invalid JSON)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def event(obj: Any) -> str:
    """One SSE event carrying ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


def parse_events(text: str | Iterable[str]) -> list[Any]:
    """Parse an SSE body back into JSON objects (``"[DONE]"`` stays a string). For tests and
    clients; tolerant of CRLF line ends and comment lines."""
    if not isinstance(text, str):
        text = "".join(text)
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue
        payload = "\n".join(data)
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def sse_response(chunks: AsyncIterator[str], headers: dict[str, str] | None = None
                 ) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={**SSE_HEADERS, **(headers or {})})
