"""Reading the server's Server-Sent Events back in tests (the inverse of ``server.sse.event``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def parse_events(text: str | Iterable[str]) -> list[Any]:
    """Parse an SSE body back into JSON objects (``"[DONE]"`` stays a string); tolerant of
    CRLF line ends and comment lines."""
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
