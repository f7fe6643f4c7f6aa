"""The KV page's routes (added by ``build_app`` unless ``--no-kv-page``):

- ``GET /kv``: the page (``static/kv.html``, its CSS and JS under ``/kv/static/``; no CDN, works
  on an air-gapped host);
- ``GET /kv/state``: the JSON document of :mod:`server.kv_page.state`, from a snapshot taken on
  the engine thread for this request;
- ``GET /kv/events``: server-sent events, ``event: state`` with the same document whenever it
  changed (polled every ``interval`` seconds, 0.1..10, default 0.5). Each stream ends by itself
  after :data:`STREAM_LIFETIME` seconds with ``retry: RETRY_MS``: an EventSource reconnects
  after that many milliseconds and gets the current state at once. The lifetime bounds what a
  stream costs the engine thread (a snapshot per interval) under ``--limit-concurrency``; at
  the limit the reconnect gets the 503 and the page falls back to polling ``/kv/state``.

With ``--api-key`` all three need the key (a header, or ``?key=`` since a browser cannot send a
header for a page or an EventSource: server/auth.py)."""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.errors import APIError, bad_request
from server.kv_page.state import PrefixText, state_document
from server.sse import SSE_HEADERS

STATIC = {"kv.css": "text/css; charset=utf-8", "kv.js": "text/javascript; charset=utf-8",
          "kv.html": "text/html; charset=utf-8"}
SNAPSHOT_TIMEOUT = 10.0  # seconds: a step longer than this is a stuck engine
STREAM_LIFETIME = 60.0  # seconds a /kv/events stream stays open (read per stream)
RETRY_MS = 1000  # the reconnection delay the stream's last line asks of an EventSource


def _static(name: str) -> bytes:
    return resources.files("server.kv_page").joinpath("static", name).read_bytes()


def add_routes(app: FastAPI, engine: Any) -> None:
    decode = PrefixText(engine.tokenizer)
    files = {name: _static(name) for name in STATIC}  # read once: the package may move

    async def document() -> dict[str, Any]:
        snapshot = getattr(getattr(engine, "core", None), "kv_snapshot", None)
        if snapshot is None:
            raise APIError(404, "this engine has no KV snapshot", code="not_found")
        if not engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        fut = engine.call_on_engine_thread(snapshot)
        try:
            snap = await asyncio.wait_for(asyncio.wrap_future(fut), SNAPSHOT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - dead engine, stuck step
            raise APIError(503, f"no KV snapshot: {type(exc).__name__}",
                           code="engine_busy") from None
        return state_document(snap, decode)

    @app.get("/kv", include_in_schema=False)
    async def kv_page() -> Response:
        return Response(files["kv.html"], media_type=STATIC["kv.html"],
                        headers={"Cache-Control": "no-store"})

    @app.get("/kv/static/{name}", include_in_schema=False)
    async def kv_static(name: str) -> Response:
        if name not in STATIC or name == "kv.html":
            raise APIError(404, f"no such file: {name}", code="not_found")
        return Response(files[name], media_type=STATIC[name])

    @app.get("/kv/state")
    async def kv_state() -> JSONResponse:
        """The KV pool now (documented in server/kv_page/state.py)."""
        return JSONResponse(await document(), headers={"Cache-Control": "no-store"})

    @app.get("/kv/events")
    async def kv_events(raw: Request, interval: float = 0.5) -> StreamingResponse:
        """The KV pool as server-sent events: ``event: state`` when it changed."""
        if not 0.1 <= interval <= 10:
            raise bad_request("interval must be between 0.1 and 10 seconds",
                              param="interval")

        async def stream():
            last = None
            idle = 0.0
            loop = asyncio.get_running_loop()
            ends = loop.time() + STREAM_LIFETIME
            while True:
                if await raw.is_disconnected() or app.state.ctx.draining_since is not None:
                    return
                if loop.time() >= ends:  # frees its --limit-concurrency slot; the client
                    yield f"retry: {RETRY_MS}\n\n"  # reconnects after RETRY_MS
                    return
                try:
                    doc = await document()
                except APIError as exc:
                    yield f"event: error\ndata: {json.dumps(exc.message)}\n\n"
                    return
                body = dict(doc)
                body.pop("seq_no"), body.pop("time")
                if body != last:
                    last = body
                    idle = 0.0
                    yield f"event: state\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n"
                else:
                    idle += interval
                    if idle >= 15:
                        idle = 0.0
                        yield ": ping\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
