"""DELETE /v1/responses/{id} of a response that is still being generated (streamed or not):
the DELETE succeeds (``deleted: true``), the generation goes on to its end for its own client,
and the finished response is not stored (GET, a second DELETE and ``previous_response_id``
are 404). Over a real uvicorn server with the fake core, held between steps so that the DELETE
lands mid-stream deterministically."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, assert_error


@pytest.fixture()
def srv():
    core = FakeCore()
    with ServerThread(build_app(AsyncEngine(core=core), ServerSettings())) as server:
        server.core = core
        try:
            yield server
        finally:
            core.resume()  # a failed test must not leave the engine waiting inside a step


def _events(lines):
    """(type, data) of each SSE event from an iterator of lines."""
    kind = None
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


def test_delete_while_streaming_succeeds_and_the_response_is_not_stored(srv):
    srv.core.pause()
    with httpx.stream("POST", f"{srv.url}/v1/responses", timeout=60, json={
            "model": "fake-model", "input": "hi", "max_output_tokens": 6,
            "stream": True}) as r:
        assert r.status_code == 200
        events = _events(r.iter_lines())
        kind, created = next(events)
        assert kind == "response.created"
        rid = created["response"]["id"]
        srv.core.allow(2)  # two tokens out, then the engine waits inside a step
        for kind, _ in events:
            if kind == "response.output_text.delta":
                break
        d = httpx.delete(f"{srv.url}/v1/responses/{rid}", timeout=30)
        assert d.status_code == 200, d.text
        assert d.json() == {"id": rid, "object": "response", "deleted": True}
        srv.core.resume()
        kinds = [k for k, _ in events]
    assert kinds[-1] == "response.incomplete"  # the stream itself went on to its end
    assert_error(httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30), 404,
                 code="response_not_found")
    assert_error(httpx.delete(f"{srv.url}/v1/responses/{rid}", timeout=30), 404)
    assert_error(httpx.post(f"{srv.url}/v1/responses", timeout=30, json={
        "model": "fake-model", "input": "more", "previous_response_id": rid}), 404,
        param="previous_response_id")


def test_delete_while_a_non_streamed_response_is_generated(srv):
    srv.core.pause()
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        f"{srv.url}/v1/responses", timeout=60, json={"model": "fake-model", "input": "hi",
                                                     "max_output_tokens": 4})))
    t.start()
    try:
        pending = srv.server.config.app.state.responses_store.pending_ids
        for _ in range(3000):  # until the request is in the engine
            if pending():
                break
            t.join(0.01)
        (rid,) = pending()
        d = httpx.delete(f"{srv.url}/v1/responses/{rid}", timeout=30)
        assert d.status_code == 200 and d.json()["deleted"] is True
    finally:
        srv.core.resume()
        t.join(60)
    r = result["r"]
    assert r.status_code == 200 and r.json()["id"] == rid
    assert_error(httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30), 404)


def test_a_finished_stream_is_stored_and_pending_entries_do_not_pile_up(srv):
    ids = []
    for _ in range(3):
        with httpx.stream("POST", f"{srv.url}/v1/responses", timeout=60, json={
                "model": "fake-model", "input": "hi", "max_output_tokens": 2,
                "stream": True}) as r:
            events = list(_events(r.iter_lines()))
            assert events[-1][0] == "response.incomplete"
            ids.append(events[0][1]["response"]["id"])
    for rid in ids:
        assert httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30).status_code == 200
    # A stream whose client leaves early is not stored, and leaves nothing pending.
    with httpx.stream("POST", f"{srv.url}/v1/responses", timeout=60, json={
            "model": "fake-model", "input": "hi", "max_output_tokens": 50,
            "stream": True}) as r:
        next(_events(r.iter_lines()))
    store = srv.server.config.app.state.responses_store
    for _ in range(3000):
        if not store.pending_ids():
            break
        threading.Event().wait(0.01)
    assert store.pending_ids() == []
