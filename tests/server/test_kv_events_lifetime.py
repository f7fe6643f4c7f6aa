"""``GET /kv/events`` holds a ``--limit-concurrency`` slot while it is open (it is a request in
flight and an open connection), so each stream's lifetime is bounded: it ends by itself after
``server.kv_page.routes.STREAM_LIFETIME`` seconds with an SSE ``retry:`` hint (an EventSource
reconnects after that many milliseconds), and the slot is free again. On a tiny random model
in-process, with the lifetime shortened for the test."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from server.config_file import ServerSettings
from server.kv_page import routes
from tests.server.helpers import ServerThread, assert_error


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("kvlife") / "tiny",
                                max_position_embeddings=64)
    engine = AsyncEngine(EngineConfig(model=str(model), dtype="float32", block_size=4,
                                      kv_cache_memory="1MiB"))
    with ServerThread(build_app(engine, ServerSettings(limit_concurrency=1))) as srv:
        yield srv


def test_an_open_events_stream_ends_by_itself_and_frees_its_slot(server, monkeypatch):
    monkeypatch.setattr(routes, "STREAM_LIFETIME", 1.0, raising=False)
    # Reads time out well before the idle keep-alive comment (15 s), so a stream that never
    # ends fails here instead of hanging.
    with httpx.Client(timeout=httpx.Timeout(10.0)) as client:
        with client.stream("GET", f"{server.url}/kv/events?interval=0.1") as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines) == "event: state"
            assert json.loads(next(lines).removeprefix("data: "))["version"] == 1
            # While it is open it holds the only slot: other work is refused, /health is not.
            assert_error(httpx.get(f"{server.url}/v1/models", timeout=30), 503,
                         code="server_overloaded")
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            rest = list(lines)  # to the end of the stream
        retry = [line for line in rest if line.startswith("retry:")]
        assert retry and int(retry[-1].removeprefix("retry:").strip()) > 0
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200


def test_the_default_lifetime_is_bounded():
    assert 0 < routes.STREAM_LIFETIME <= 600
