"""The KV page's data and the profiler endpoints on a tiny random model in-process (fast): what
``/kv/state`` reports equals the engine's own pool (an independent count: the manager's
``stats()`` and ``check_integrity``), a shared prefix shows up with its text, the page and its
files are served from the package, the key guards them, and ``/start_profile`` /
``/stop_profile`` write a trace that parses (404 without ``--profiler-dir``). The real-browser
test is tests/server/kv_page/test_kv_page_browser.py (slow)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.helpers import ServerThread

KEY = "kv-key"


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvpage")
    model = make_tiny_model_dir(tmp / "tiny", max_position_embeddings=256)
    config = EngineConfig(model=str(model), served_model_name="tiny", dtype="float32",
                          block_size=4, kv_cache_memory="1MiB", enable_prefix_caching=True)
    engine = AsyncEngine(config)
    settings = ServerSettings(api_key=KEY, profiler_dir=str(tmp / "traces"))
    with ServerThread(build_app(engine, settings)) as srv:
        yield srv, engine, tmp / "traces"


def _get(srv, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=60, **kw)


def _complete(srv, prompt: str, max_tokens: int = 4) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_state_matches_the_pool_and_shows_a_shared_prefix(kv_server):
    srv, engine, _ = kv_server
    idle = _get(srv, "/kv/state").json()
    assert idle["version"] == 1 and idle["requests"] == []
    shared = "the quick brown fox jumps over the lazy dog " * 3
    _complete(srv, shared + "one")
    _complete(srv, shared + "two")  # a prefix hit on the first one's blocks
    doc = _get(srv, "/kv/state").json()
    truth = engine.call_on_engine_thread(lambda: (engine.core.kv.stats(),
                                                  engine.core.kv.check_integrity())).result(30)
    stats = truth[0]
    dev = doc["tiers"][0]
    assert dev["name"] == "device" and dev["num_blocks"] == stats.num_blocks
    assert dev["used"] == stats.num_used_blocks == 0  # idle: every block is back
    assert dev["cached_free"] == stats.num_free_cached_blocks > 0
    assert dev["free"] + dev["cached_free"] + dev["used"] == dev["num_blocks"]
    assert len(doc["blocks"]) == dev["num_blocks"]
    assert doc["blocks"].count("c") == dev["cached_free"]
    assert doc["prefix_cache"]["hits_tokens"] == stats.prefix_cache_hits > 0
    top = doc["prefix_cache"]["top"]
    assert top and top[0]["num_requests"] >= 1 and top[0]["text"] in shared
    assert len(top[0]["text"]) > 8
    a = doc["arithmetic"]
    assert a["bytes_per_token"] == 2 * a["num_layers"] * a["num_kv_heads"] * a["row_bytes"]
    assert a["bytes_per_token"] == engine.core.runner.kv_bytes_per_token


def test_running_request_shows_its_blocks(kv_server):
    srv, engine, _ = kv_server
    done = threading.Event()

    def long_request():
        _complete(srv, "a b c d e f g h i j k l", max_tokens=150)
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    seen = None
    try:
        for _ in range(400):
            doc = _get(srv, "/kv/state").json()
            if doc["requests"]:
                seen = doc
                break
            if done.is_set():
                break
    finally:
        t.join(120)
    assert seen is not None, "the request finished before a snapshot saw it"
    (req,) = seen["requests"]
    assert req["num_blocks"] == len([b for b in req["block_ids"] if b >= 0]) > 0
    assert seen["tiers"][0]["used"] == req["num_blocks"]
    assert seen["blocks"].count("u") + seen["blocks"].count("s") == req["num_blocks"]
    assert all(seen["blocks"][b] in "us" for b in req["block_ids"])


def test_page_events_and_key(kv_server):
    srv, _, _ = kv_server
    assert httpx.get(f"{srv.url}/kv", timeout=30).status_code == 401
    assert httpx.get(f"{srv.url}/kv/state", timeout=30).status_code == 401
    page = httpx.get(f"{srv.url}/kv?key={KEY}", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from elsewhere
    for name in ("kv.js", "kv.css"):
        assert httpx.get(f"{srv.url}/kv/static/{name}", timeout=30).status_code == 200
    assert httpx.get(f"{srv.url}/kv/static/other.js", timeout=30).status_code == 404
    with httpx.stream("GET", f"{srv.url}/kv/events?key={KEY}&interval=0.1",
                      timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines) == "event: state"
        doc = json.loads(next(lines).removeprefix("data: "))
        assert doc["version"] == 1 and doc["tiers"][0]["name"] == "device"
    assert _get(srv, "/kv/events", params={"interval": "0"}).status_code == 400
    assert _get(srv, "/kv/events", params={"interval": "x"}).status_code == 400
    schema = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()
    assert "/kv/state" in schema["paths"] and "/kv/events" in schema["paths"]
    assert "HTTPValidationError" not in json.dumps(schema)


def test_profiler_writes_a_trace(kv_server):
    srv, _, traces = kv_server
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{srv.url}/start_profile", timeout=30).status_code == 401
    assert httpx.post(f"{srv.url}/stop_profile", headers=h, timeout=30).status_code == 409
    r = httpx.post(f"{srv.url}/start_profile", headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{srv.url}/start_profile", headers=h, timeout=60).status_code == 409
    _complete(srv, "profile me", max_tokens=3)
    r = httpx.post(f"{srv.url}/stop_profile", headers=h, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_steps"] >= 3
    trace = json.loads(open(body["trace"]).read())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "kvserve::step" in names
    assert body["trace"].startswith(str(traces))


def test_routes_absent_without_flags(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", max_position_embeddings=64)
    engine = AsyncEngine(EngineConfig(model=str(model), dtype="float32", block_size=4,
                                      kv_cache_memory="1MiB"))
    app = build_app(engine, ServerSettings(kv_page=False))
    with ServerThread(app) as srv:
        for path in ("/start_profile", "/stop_profile"):
            assert httpx.post(f"{srv.url}{path}", timeout=30).status_code == 404
        assert httpx.get(f"{srv.url}/kv", timeout=30).status_code == 404
        assert httpx.get(f"{srv.url}/kv/state", timeout=30).status_code == 404
