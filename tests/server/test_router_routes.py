"""The endpoints routers probe (server/router_routes.py), over a real uvicorn server and the real
AsyncEngine with a fake core: each body in the shape the routers' own code parses (the fields
and types of sglang-router's and vllm-router's serde structs, with no two keys one struct reads
as the same field), the cache resets behind the API key and on the engine thread, the health
probe's one real token, the KV-event sources vllm-router subscribes to, and the block-size
info metric llm-d's scheduler reads. The real routers are in test_router_e2e.py."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config.kv_events import KVEventsConfig
from server.app import build_app
from server.config_file import ServerSettings
from server.router_routes import resolve_endpoint
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, sample, scrape

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class TieredCore(FakeCore):
    """A fake core with the KV tiers' reset: records each call and the thread it ran on."""

    def __init__(self, tiers=("device", "host", "disk"), **kw) -> None:
        super().__init__(**kw)
        self.tiers = list(tiers)
        self.resets: list[tuple[list[str] | None, str]] = []

    def cache_tiers(self) -> list[str]:
        return list(self.tiers)

    def reset_prefix_cache(self, tiers=None):
        self.resets.append((None if tiers is None else list(tiers),
                            threading.current_thread().name))
        want = self.tiers if tiers is None else list(tiers)
        unknown = [t for t in want if t not in self.tiers]
        if unknown:
            raise ValueError(f"no {', '.join(unknown)} KV tier on this server")
        return {t: 7 for t in want}


class _Config:
    """The fake core's EngineConfig plus a ``kv_events_config`` (the real field may not exist
    yet: the server reads it with getattr)."""

    def __init__(self, config, kv_events) -> None:
        self._config = config
        self.kv_events_config = kv_events

    def __getattr__(self, name):
        return getattr(self._config, name)


def _wait_until(cond, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if cond():
            return
        threading.Event().wait(0.02)
    raise AssertionError("condition not reached")


def _server(core, **settings):
    engine = AsyncEngine(core=core)
    return ServerThread(build_app(engine, ServerSettings(**settings)))


@pytest.fixture(scope="module")
def srv():
    core = TieredCore()
    core.hf_config = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    with _server(core, api_key=KEY) as s:
        s.core = core
        yield s
    core.resume()


def test_server_info_has_what_both_routers_read(srv):
    for path in ("/get_server_info", "/server_info"):
        r = httpx.get(srv.url + path, timeout=10)  # no key: vllm-router sends none
        assert r.status_code == 200, r.text
        info = r.json()
        # sglang-router: model id from served_model_name (else model_path), tokenizer from
        # tokenizer_path / model_path; vllm-router: model_id and kv_block_size
        assert info["served_model_name"] == info["model_id"] == "fake-model"
        assert info["model_path"] and info["tokenizer_path"]
        assert info["kv_block_size"] == info["page_size"] == srv.core.config.block_size
        assert info["max_model_len"] == info["context_length"] == 256
        assert info["dp_size"] == 1 and info["max_running_requests"] == 4
        assert info["cache_tiers"] == ["device", "host", "disk"]
        assert info["kv_events_endpoint"] is None
        # serde aliases: "block_size" is vllm-router's other name of kv_block_size, "model"
        # sglang-router's of model_id; both present would be a duplicate-field error
        assert "block_size" not in info and "model" not in info
        for key in ("dp_size", "max_running_requests", "max_total_num_tokens", "kv_block_size"):
            assert isinstance(info[key], int) and info[key] >= 0  # usize / u32 fields


def test_model_info_is_sglangs(srv):
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(srv.url + path, timeout=10).json()
        assert info["is_generation"] is True and info["model_type"] == "llama"
        assert info["architectures"] == ["LlamaForCausalLM"]
        assert info["model_path"] and info["tokenizer_path"]


def test_get_load_is_a_list_per_dp_rank_with_num_tokens(srv):
    srv.core.allow(1)  # the request is admitted and held inside its second step
    t = threading.Thread(target=httpx.post, args=(f"{srv.url}/v1/completions",), kwargs=dict(
        headers=AUTH, timeout=30, json={"prompt": "x", "max_tokens": 5}))
    t.start()
    try:
        _wait_until(lambda: srv.core.steps >= 1)
        _wait_until(lambda: httpx.get(srv.url + "/get_load", timeout=10).json()[0]["num_reqs"])
        load = httpx.get(srv.url + "/get_load", timeout=10).json()
    finally:
        srv.core.resume()
        t.join(30)
    assert isinstance(load, list) and len(load) == 1
    entry = load[0]
    assert entry["dp_rank"] == 0
    assert entry["num_reqs"] == 1 and entry["num_waiting_reqs"] == 0
    # sglang-router sums num_tokens: KV tokens held (the fake holds one block per request)
    assert entry["num_tokens"] == srv.core.config.block_size
    assert all(isinstance(entry[k], int) for k in ("num_reqs", "num_waiting_reqs", "num_tokens"))


def test_cache_resets_need_the_key_and_run_on_the_engine_thread(srv):
    for path in ("/flush_cache", "/reset_prefix_cache"):
        assert httpx.post(srv.url + path, timeout=10).status_code == 401
        r = httpx.post(srv.url + path, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True,
                            "dropped_blocks": {"device": 7, "host": 7, "disk": 7}}
        tiers, thread = srv.core.resets[-1]
        assert tiers is None and thread == "kvserve-engine"


@pytest.mark.parametrize("query,tiers", [
    ("tier=disk", ["disk"]), ("tier=device,host", ["device", "host"]),
    ("tier=device&tier=disk", ["device", "disk"]), ("device=gpu", ["device"]),
    ("device=cpu", ["host"])])
def test_a_reset_names_its_tiers(srv, query, tiers):
    r = httpx.post(f"{srv.url}/reset_prefix_cache?{query}", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert srv.core.resets[-1][0] == tiers
    assert list(r.json()["dropped_blocks"]) == tiers


@pytest.mark.parametrize("query,param", [
    ("tier=remote", "tier"), ("device=tpu", "device"), ("reset_running_requests=true",
                                                        "reset_running_requests")])
def test_a_bad_reset_is_a_400_naming_the_parameter(srv, query, param):
    r = httpx.post(f"{srv.url}/flush_cache?{query}", headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_health_generate_runs_one_token(srv):
    before = srv.core.generation_tokens
    r = httpx.get(srv.url + "/health_generate", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert srv.core.generation_tokens == before + 1
    assert not srv.core.requests  # nothing left behind


def test_health_generate_probes_in_flight_share_one_request(srv):
    srv.core.pause()
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.get(srv.url + "/health_generate", timeout=30).status_code)) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        _wait_until(lambda: srv.core.requests)
        threading.Event().wait(0.3)  # the other three arrive while the first waits
        assert len(srv.core.requests) == 1
    finally:
        srv.core.resume()
        for t in threads:
            t.join(30)
    assert results == [200] * 4


def test_health_generate_is_503_once_the_engine_died():
    core = TieredCore()
    with _server(core) as s:
        core.fail_next_step = RuntimeError("forward pass failed")
        httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        r = httpx.get(s.url + "/health_generate", timeout=30)
        assert r.status_code == 503, r.text
        assert httpx.post(s.url + "/flush_cache", timeout=10).status_code == 503


def test_kv_event_sources_empty_when_events_are_off(srv):
    r = httpx.get(srv.url + "/kv_event_sources", timeout=10)
    assert r.status_code == 200 and r.json() == {}


@pytest.mark.parametrize("host,expect", [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "127.0.0.1")])
def test_kv_event_sources_name_a_reachable_endpoint(host, expect):
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                            replay_endpoint="tcp://*:5558", topic="kv")
    core = TieredCore()
    core.config = _Config(core.config, events)
    with _server(core, host=host) as s:
        body = httpx.get(s.url + "/kv_event_sources", timeout=10).json()
        info = httpx.get(s.url + "/get_server_info", timeout=10).json()
    # vllm-router's KvEventSourceEntry map, keyed by DP rank; it subscribes only with these
    src = body["0"]
    assert src["endpoint"] == f"tcp://{expect}:5557"
    assert src["replay_endpoint"] == f"tcp://{expect}:5558"
    assert (src["publisher"], src["encoding"], src["schema_version"]) == ("zmq", "msgpack", 1)
    assert src["topic"] == "kv" and src["enable_kv_cache_events"] is True
    assert info["kv_events_endpoint"] == src["endpoint"]


def test_kv_event_sources_null_publisher_is_off():
    core = TieredCore()
    core.config = _Config(core.config, replace(KVEventsConfig(enable_kv_cache_events=True),
                                               publisher="null"))
    with _server(core) as s:
        assert httpx.get(s.url + "/kv_event_sources", timeout=10).json() == {}


def test_resolve_endpoint():
    assert resolve_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "h.example") == "tcp://h.example:5557"
    assert resolve_endpoint("tcp://[::]:5557", "::1") == "tcp://[::1]:5557"
    assert resolve_endpoint("tcp://10.1.1.1:5557", "x") == "tcp://10.1.1.1:5557"
    assert resolve_endpoint("ipc:///tmp/kv", "x") == "ipc:///tmp/kv"


def test_metrics_block_size_info_and_hit_rate(srv):
    metrics = scrape(srv.url)
    assert sample(metrics, "kvserve:cache_config_info", model_name="fake-model",
                  block_size=str(srv.core.config.block_size), num_gpu_blocks="100",
                  enable_prefix_caching="True") == 1.0
    assert ("kvserve:prefix_cache_hit_rate", (("model_name", "fake-model"),)) in metrics


def test_an_http2_preface_is_a_505_not_a_404(srv, caplog):
    """sglang-router's client sends the HTTP/2 prior-knowledge preface once before falling
    back to HTTP/1.1: answered 505 (and logged so), not a 404 that reads as a missing route."""
    import socket

    with caplog.at_level("INFO", logger="kvserve.server"), \
            socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 505 "), answer[:100]
    assert httpx.get(srv.url + "/get_server_info", timeout=10).status_code == 200
    assert any("PRI * 505" in r.getMessage() for r in caplog.records)
    assert not any(" 404 " in r.getMessage() for r in caplog.records)
