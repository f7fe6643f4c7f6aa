"""Multi-LoRA serving end to end: a real ``python -m server.cli serve <tiny model>
--enable-lora --allow-runtime-lora-updating --lora-modules sql=DIR`` on a loopback port, PEFT
adapters written by ``peft`` itself on the tiny random model, and the real ``openai`` SDK.

The truth is peft's own forward pass: greedy text under an adapter is what HF transformers +
peft generate from the same weights (float32), and the base model's is the plain model's. The
adapter is listed with its parent, serves completions, chat and embeddings, one loaded at run
time serves too, and once unloaded it is a 404."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from engine.loading.tiny import make_tiny_model_dir
from tests.server.helpers import start_server_process

pytestmark = pytest.mark.slow
KEY = "lora-e2e-key"
PROMPT = "The cat sat on"
MAX_TOKENS = 8


def _make_adapter(model_dir, out_dir, seed: int):
    """A PEFT LoRA (r=4, random A and B) over the tiny model, saved into ``out_dir``; returns
    the in-memory peft model (the reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                           "down_proj"],
                        init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    model.save_pretrained(out_dir)
    return model


def _greedy(model, tokenizer) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("lora-e2e")
    model_dir = make_tiny_model_dir(tmp / "tiny", "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    refs = {"tiny": _greedy(AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval(), tokenizer)}
    dirs = {}
    for name, seed in (("sql", 1), ("fr", 2)):
        dirs[name] = tmp / name
        refs[name] = _greedy(_make_adapter(model_dir, dirs[name], seed), tokenizer)
    assert len(set(refs.values())) == 3  # the adapters change the greedy text
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", str(model_dir), "--served-model-name", "tiny",
         "--dtype", "float32", "--kv-cache-dtype", "float32", "--kv-cache-memory", "8MiB",
         "--max-model-len", "256", "--api-key", KEY, "--generation-config", "vllm",
         "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
         "--lora-modules", f"sql={dirs['sql']}"], tmp / "server.log", timeout=600)
    try:
        yield url, dirs, refs, tmp / "server.log"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) in (0, -signal.SIGTERM)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"})


def _complete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert r.model == model
    return r.choices[0].text


def test_multi_lora_serving(served):
    url, dirs, refs, log = served
    client = _client(url)

    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "sql"]
    assert models["sql"].parent == "tiny" and models["sql"].root == str(dirs["sql"])
    assert models["tiny"].parent is None

    # each model's greedy text is peft's / transformers' own, whatever runs beside it
    assert _complete(client, "tiny") == refs["tiny"], log.read_text()[-3000:]
    assert _complete(client, "sql") == refs["sql"], log.read_text()[-3000:]
    chat = client.chat.completions.create(model="sql", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "sql" and chat.choices[0].finish_reason in ("length", "stop")
    base_vec = client.embeddings.create(model="tiny", input="hi").data[0].embedding
    sql_vec = client.embeddings.create(model="sql", input="hi").data[0].embedding
    assert len(base_vec) == len(sql_vec) and base_vec != sql_vec

    # load another adapter at run time: listed, and it serves its own weights
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": str(dirs["fr"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fr' added successfully."
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "fr"]
    assert client.models.retrieve("fr").parent == "tiny"
    assert _complete(client, "fr") == refs["fr"]
    # the base model and both adapters at once (batched as they overlap): each its own weights
    models = ["tiny", "sql", "fr"] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: _complete(client, m), models))
    assert texts == [refs[m] for m in models]
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": str(dirs["fr"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(log)})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    # unload it: no longer listed, a request naming it is a 404, a second unload too
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "fr"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fr' removed successfully."
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fr", prompt=PROMPT, max_tokens=2)
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "fr"})
    assert r.status_code == 404
    # the others serve on, unchanged
    assert _complete(client, "sql") == refs["sql"] and _complete(client, "tiny") == refs["tiny"]
    # vLLM's lora_requests_info, in the real Prometheus text format
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{url}/metrics", timeout=60).text)}
    sample = families["kvserve:lora_requests_info"].samples[0]
    assert sample.labels["max_lora"] == "4" and sample.value > 0


def test_the_runtime_routes_need_the_key(served):
    url = served[0]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert r.status_code == 401
    assert "sql" in [m.id for m in _client(url).models.list().data]
