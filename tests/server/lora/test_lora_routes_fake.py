"""LoRA on the HTTP layer over a real uvicorn server and the real AsyncEngine, with a fake core
whose adapter registry stands in for engine.adapters (quick and exact): a request's ``model``
selects an adapter on every endpoint (it reaches ``SamplingParams.lora_name`` and comes back as
the reported model), ``/v1/models`` lists adapters with their parent, the load/unload routes
answer vLLM's texts and OpenAI-shaped errors, sit behind ``--api-key``, and exist only with the
runtime-updating gate."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from server.errors import APIError
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread

KEY = "lora-key"


class FakeAdapters:
    """engine.adapters.Adapters' interface: a directory with an ``adapter_config.json`` is an
    adapter; anything else is refused as bad files."""

    def __init__(self) -> None:
        self.loaded: dict[str, tuple[str, int]] = {}
        self.next_id = 1
        self.names: frozenset[str] = frozenset()
        self.listing: tuple[tuple[str, str, int], ...] = ()

    def read(self, name: str, path: str) -> tuple[str, str]:
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{path}: no adapter_config.json (not a PEFT LoRA directory)")
        return name, path

    def add(self, adapter: tuple[str, str]) -> int:
        name, path = adapter
        if name in self.loaded:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        self.loaded[name] = (path, self.next_id)
        self.next_id += 1
        self._publish()
        return self.loaded[name][1]

    def remove(self, name: str) -> None:
        del self.loaded[name]
        self._publish()

    def _publish(self) -> None:
        self.listing = tuple((n, p, i) for n, (p, i) in self.loaded.items())
        self.names = frozenset(self.loaded)


class LoRAFakeCore(FakeCore):
    """FakeCore that checks ``lora_name`` as EngineCore does and records it per request."""

    def __init__(self, adapters: FakeAdapters | None) -> None:
        super().__init__()
        self.adapters = adapters
        self.loras: list[str | None] = []

    def check_request(self, prompt_token_ids, params, *, priority: int = 0,
                      images: tuple = ()) -> None:
        super().check_request(prompt_token_ids, params, priority=priority, images=images)
        if params.lora_name is not None and (self.adapters is None or
                                             params.lora_name not in self.adapters.names):
            raise ValueError(f"LoRA adapter {params.lora_name!r} is not loaded")

    def add_request(self, request_id, prompt_token_ids, params, **kwargs) -> None:
        self.check_request(prompt_token_ids, params)
        self.loras.append(params.lora_name)
        super().add_request(request_id, prompt_token_ids, params, **kwargs)


def _adapter_dir(path: Path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def _serve(adapters: FakeAdapters | None, **settings) -> ServerThread:
    core = LoRAFakeCore(adapters)
    srv = ServerThread(build_app(AsyncEngine(core=core), ServerSettings(**settings)))
    srv.core = core
    srv.headers = {"Authorization": f"Bearer {KEY}"}
    return srv


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    adapters = FakeAdapters()
    tmp = tmp_path_factory.mktemp("adapters")
    adapters.add(adapters.read("sql", _adapter_dir(tmp / "sql")))
    with _serve(adapters, api_key=KEY, allow_runtime_lora_updating=True) as srv:
        srv.tmp = tmp
        srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
        yield srv
    srv.core.resume()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=srv.headers, timeout=30)


def test_check_model_resolves_base_names_and_adapters(lora_server):
    ctx = lora_server.server.config.app.state.ctx
    assert ctx.check_model(None) == ctx.check_model("fake-model") == "fake-model"
    assert ctx.check_model("sql") == "sql"
    assert ctx.lora_of("fake-model") is None and ctx.lora_of("sql") == "sql"
    with pytest.raises(APIError) as info:
        ctx.check_model("nope")
    err = info.value
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "'fake-model'" in err.message and "'sql'" in err.message


def test_models_lists_the_base_then_each_adapter_with_its_parent(lora_server):
    models = lora_server.client.models.list().data
    assert [m.id for m in models][:2] == ["fake-model", "sql"]
    sql = models[1]
    assert sql.parent == "fake-model" and sql.root == str(lora_server.tmp / "sql")
    assert sql.owned_by == "kvserve" and sql.object == "model"
    assert models[0].parent is None
    assert lora_server.client.models.retrieve("sql").root == sql.root
    with pytest.raises(openai.NotFoundError):
        lora_server.client.models.retrieve("nope")


def test_every_endpoint_runs_under_the_adapter_its_model_names(lora_server):
    client, core = lora_server.client, lora_server.core
    for model, lora in (("sql", "sql"), ("fake-model", None)):
        core.loras.clear()
        r = client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert r.model == model and r.choices[0].text == "ab"
        chunks = list(client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                                stream=True))
        assert {c.model for c in chunks} == {model}
        c = client.chat.completions.create(model=model, max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert c.model == model
        resp = client.responses.create(model=model, input="Hi", max_output_tokens=2)
        assert resp.model == model
        msg = _post(lora_server, "/v1/messages", {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert msg.status_code == 200 and msg.json()["model"] == model
        assert core.loras == [lora] * 5
        tok = _post(lora_server, "/tokenize", {"model": model, "prompt": "Hi"})
        assert tok.status_code == 200 and tok.json()["tokens"] == [72, 105]


def test_an_unknown_model_is_openais_404(lora_server):
    with pytest.raises(openai.NotFoundError) as info:
        lora_server.client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    r = _post(lora_server, "/v1/chat/completions", {
        "model": "nope", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_load_serve_unload_then_404(lora_server):
    path = _adapter_dir(lora_server.tmp / "fr")
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": path})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'fr' added successfully."
    ids = [m.id for m in lora_server.client.models.list().data]
    assert ids[0] == "fake-model" and ids.index("fr") > ids.index("sql")
    lora_server.core.loras.clear()
    out = lora_server.client.completions.create(model="fr", prompt="x", max_tokens=1)
    assert out.model == "fr" and lora_server.core.loras == ["fr"]

    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "fr"})
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'fr' removed successfully."
    assert "fr" not in [m.id for m in lora_server.client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        lora_server.client.completions.create(model="fr", prompt="x", max_tokens=1)
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "fr"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"lora_name": "sql", "lora_path": "SQL"}, "lora_name", "already been loaded"),
    ({"lora_name": "fake-model", "lora_path": "SQL"}, "lora_name", "base model"),
    ({"lora_name": "bad", "lora_path": "/nonexistent/adapter"}, "lora_path",
     "adapter_config.json"),
    ({"lora_name": "", "lora_path": "SQL"}, "lora_name", "must be provided"),
    ({"lora_name": "x"}, "lora_path", ""),  # a missing field: the validation 400
])
def test_bad_loads_are_openai_shaped_400s(lora_server, body, param, fragment):
    body = {k: str(lora_server.tmp / "sql") if v == "SQL" else v for k, v in body.items()}
    r = _post(lora_server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert param in (error["param"] or "")
    assert "bad" not in [m.id for m in lora_server.client.models.list().data]


def test_the_routes_need_the_api_key(lora_server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(f"{lora_server.url}{path}", json={"lora_name": "sql"}, timeout=30)
        assert r.status_code == 401
    assert "sql" in [m.id for m in lora_server.client.models.list().data]


def test_without_the_gate_the_routes_do_not_exist(tmp_path):
    with _serve(FakeAdapters()) as srv:
        path = _adapter_dir(tmp_path / "fr")
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                       json={"lora_name": "fr", "lora_path": path}, timeout=30)
        assert r.status_code == 404 and "error" in r.json()
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "fr"},
                       timeout=30)
        assert r.status_code == 404
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == \
            ["fake-model"]


def test_a_load_with_lora_off_is_a_400(tmp_path):
    with _serve(None, allow_runtime_lora_updating=True) as srv:
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", timeout=30, json={
            "lora_name": "fr", "lora_path": _adapter_dir(tmp_path / "fr")})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "fr"},
                       timeout=30)
        assert r.status_code == 404


def test_an_adapter_unloaded_after_the_check_is_a_404_at_submit(lora_server):
    from engine.params.sampling import SamplingParams
    from server.serving import submit_all

    ctx = lora_server.server.config.app.state.ctx
    path = _adapter_dir(lora_server.tmp / "brief")
    assert _post(lora_server, "/v1/load_lora_adapter",
                 {"lora_name": "brief", "lora_path": path}).status_code == 200
    model = ctx.check_model("brief")
    assert _post(lora_server, "/v1/unload_lora_adapter",
                 {"lora_name": "brief"}).status_code == 200
    with pytest.raises(APIError) as info:
        submit_all(ctx, [(None, [72, 105])], SamplingParams(max_tokens=1), "race", model=model)
    assert (info.value.status, info.value.code) == (404, "model_not_found")
