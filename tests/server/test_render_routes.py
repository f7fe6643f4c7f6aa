"""vLLM's renderer API (server/render_routes.py) over a real uvicorn server and the real
AsyncEngine with a fake core: the token ids each render returns are the ids the same request
then runs on (the core records what it was given), in vLLM's shapes (a list for completions,
one object for chat), sampling parameters and the cache salt carried, nothing generated, and a
request the real endpoint refuses refused the same way. vllm-router reading these bodies (and
asking ``/tokenize`` no more) is in test_router_e2e.py."""

from __future__ import annotations

import httpx
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread


@pytest.fixture(scope="module")
def srv():
    core = FakeCore()
    core.seen = []  # every prompt the core was given, in order
    add = core.add_request

    def recording_add(request_id, prompt_token_ids, params, **kw):
        core.seen.append(list(prompt_token_ids))
        return add(request_id, prompt_token_ids, params, **kw)

    core.add_request = recording_add
    with ServerThread(build_app(AsyncEngine(core=core), ServerSettings())) as s:
        s.core = core
        yield s
    core.resume()


def _ran_on(srv, path: str, body: dict) -> list[list[int]]:
    """The prompt ids the core received for ``body`` sent to ``path`` (generation endpoint)."""
    before = len(srv.core.seen)
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return srv.core.seen[before:]


def test_completion_render_is_what_the_completion_runs_on(srv):
    body = {"model": "fake-model", "prompt": ["Hi there", "ok"], "max_tokens": 3,
            "temperature": 0.5, "seed": 11, "stop": ["x"], "cache_salt": "tenant-a"}
    steps = srv.core.steps
    r = httpx.post(f"{srv.url}/v1/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert srv.core.steps == steps  # nothing generated
    assert isinstance(rendered, list) and len(rendered) == 2
    assert [g["token_ids"] for g in rendered] == [[ord(c) for c in "Hi there"],
                                                  [ord(c) for c in "ok"]]
    assert all(g["request_id"].startswith("cmpl-") and g["model"] == "fake-model"
               for g in rendered)
    sp = rendered[0]["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["stop"]) == (3, 0.5, 11, ["x"])
    assert rendered[0]["cache_salt"] == "tenant-a"
    assert sorted(_ran_on(srv, "/v1/completions", body)) == \
        sorted(g["token_ids"] for g in rendered)


def test_chat_render_is_what_the_chat_completion_runs_on(srv):
    body = {"model": "fake-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions/render", json=body, timeout=30)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, dict) and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 2 and rendered["cache_salt"] is None
    assert _ran_on(srv, "/v1/chat/completions", body) == [rendered["token_ids"]]
    tok = httpx.post(f"{srv.url}/tokenize", json={"messages": body["messages"]}).json()
    assert tok["tokens"] == rendered["token_ids"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions/render", {"model": "fake-model", "prompt": "x", "max_tokens": -1}, 400,
     None),
    ("/v1/chat/completions/render", {"model": "fake-model", "messages": []}, 400, None),
    ("/v1/chat/completions/render", {"model": "fake-model", "n": 9,
                                     "messages": [{"role": "user", "content": "x"}]}, 400, "n"),
])
def test_what_the_endpoint_refuses_its_render_refuses(srv, path, body, status, param):
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)
    real = httpx.post(f"{srv.url}{path.removesuffix('/render')}", json=body, timeout=30)
    assert real.status_code == status
