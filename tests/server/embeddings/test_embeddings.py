"""/v1/embeddings, /v1/rerank and /v1/score on a real server (loopback port), checked against
HF transformers on the same weights and through unmodified clients (the ``openai`` SDK,
LangChain's ``OpenAIEmbeddings``).

A tiny random Qwen3: as an embedding model (a sentence-transformers ``modules.json`` saying
last-token pooling and Normalize: ``--task auto`` resolves to embed), as a yes/no reranker
(``--task score``: Qwen3-Reranker's template, softmax over the last token's [no, yes]
logits) and as a generative model (``auto`` on a plain directory: mean-pooled embeddings as a
demonstration, rerank refused).
"""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from engine.pooling.serving import head_token_id
from server.app import build_app
from server.config_file import ServerSettings
from server.embeddings.prompts import rerank_ids
from tests.server.helpers import ServerThread

INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages.\nQ:"[:64]
assert len(INSTRUCTION) == 64  # the byte tokenizer: 64 tokens


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = make_tiny_model_dir(tmp_path_factory.mktemp("emb") / "tiny-gen", "qwen3", seed=5)
    emb = base.parent / "tiny-embed"
    shutil.copytree(base, emb)
    (emb / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (emb / "1_Pooling").mkdir()
    (emb / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    return base, emb


def _serve(path, **cfg):
    engine = AsyncEngine(EngineConfig(model=str(path), served_model_name="tiny", dtype="float32",
                                      device="cpu", kv_cache_memory="4MiB", block_size=16,
                                      max_num_seqs=16, max_num_batched_tokens=256,
                                      max_model_len=512, **cfg))
    return ServerThread(build_app(engine, ServerSettings())), engine


@pytest.fixture(scope="module")
def embed_server(model_dirs):
    srv, engine = _serve(model_dirs[1])
    with srv:
        assert engine.pooling.task == "embed"
        yield srv


@pytest.fixture(scope="module")
def hf(model_dirs):
    return AutoModel.from_pretrained(model_dirs[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs[0])


def ref(hf, tok, text: str, method="last", dims=None, normalize=True) -> torch.Tensor:
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([tok.encode(text)])).last_hidden_state[0]
    v = h[-1] if method == "last" else h.mean(0)
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def close(got, want, tol=1e-4):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=tol,
                               rtol=tol)


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "x",
         "embeddings from the same server as chat"]


def test_openai_sdk_float_and_base64(embed_server, hf, tok):
    import openai

    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="x")
    # no encoding_format: the SDK asks for base64 itself and decodes it
    for fmt in ("float", None, "base64"):
        kw = {"encoding_format": fmt} if fmt else {}
        r = client.embeddings.create(model="tiny", input=TEXTS, **kw)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        for text, d in zip(TEXTS, r.data, strict=True):
            vec = d.embedding
            if fmt == "base64":  # asked for explicitly, the SDK hands the string back
                vec = np.frombuffer(base64.b64decode(vec), dtype="<f4").tolist()
            close(vec, ref(hf, tok, text))
        assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    one = client.embeddings.create(model="tiny", input="hello world", dimensions=16)
    assert len(one.data[0].embedding) == 16
    close(one.data[0].embedding, ref(hf, tok, "hello world", dims=16))
    ids = client.embeddings.create(model="tiny", input=[tok.encode("hello world")])
    close(ids.data[0].embedding, ref(hf, tok, "hello world"))


def test_langchain_openai_embeddings(embed_server, hf, tok):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="tiny", base_url=f"{embed_server.url}/v1", api_key="x",
                           check_embedding_ctx_length=False, tiktoken_enabled=False)
    docs = emb.embed_documents(TEXTS[:2])
    for text, v in zip(TEXTS[:2], docs, strict=True):
        close(v, ref(hf, tok, text))
    close(emb.embed_query("x"), ref(hf, tok, "x"))


def test_prefix_shared_batch_equals_one_by_one(embed_server, hf, tok):
    """16 inputs sharing a 64-token instruction: the same vectors as one by one (and as HF),
    with the instruction's blocks served from the prefix cache."""
    queries = [f"{INSTRUCTION} question number {i} about topic {i * 7}" for i in range(16)]
    url = f"{embed_server.url}/v1/embeddings"
    alone = [httpx.post(url, json={"input": q}, timeout=60).json() for q in queries[:2]]
    batch = httpx.post(url, json={"input": queries}, timeout=60).json()
    assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] >= 15 * 64
    for a, b in zip(alone, batch["data"][:2], strict=True):
        close(b["embedding"], torch.tensor(a["data"][0]["embedding"]), tol=1e-5)
    for q, d in zip(queries, batch["data"], strict=True):
        close(d["embedding"], ref(hf, tok, q))


def test_embedding_errors_name_the_field(embed_server):
    url = f"{embed_server.url}/v1/embeddings"
    cases = [({"input": []}, "input"), ({"input": "a", "dimensions": 65}, "dimensions"),
             ({"input": "a" * 600}, "input"), ({"input": ["a"] * 40}, "input"),
             ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
             ({"input": "a", "model": "other"}, "model")]
    for body, field in cases:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code in (400, 404, 422), (body, r.status_code, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)


def test_rerank_by_cosine_on_an_embedding_model(embed_server, hf, tok):
    r = httpx.post(f"{embed_server.url}/v1/rerank", timeout=60, json={
        "query": "fox", "documents": TEXTS, "top_n": 2}).json()
    want = [float(ref(hf, tok, "fox") @ ref(hf, tok, d)) for d in TEXTS]
    assert len(r["results"]) == 2
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
        assert x["document"]["text"] == TEXTS[x["index"]]


@pytest.fixture(scope="module")
def score_server(model_dirs):
    srv, engine = _serve(model_dirs[0], task="score")
    with srv:
        yield srv


def _reference_scores(model_dirs, tok, query, docs, instruction=None):
    lm = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).eval()
    no, yes = head_token_id(tok, "no"), head_token_id(tok, "yes")
    out = []
    for d in docs:
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([rerank_ids(tok, query, d, instruction)])
                        ).logits[0, -1]
        pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]), 0)
        out.append(float(pair[1].exp()))
    return out


def test_rerank_scores_equal_the_yes_no_reference(score_server, model_dirs, tok):
    want = _reference_scores(model_dirs, tok, "what is a fox", TEXTS)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(f"{score_server.url}{path}", timeout=60, json={
            "model": "tiny", "query": "what is a fox",
            "documents": [{"text": t} for t in TEXTS], "return_documents": False}).json()
        assert len(r["results"]) == len(TEXTS)
        assert [x["relevance_score"] for x in r["results"]] == sorted(
            (x["relevance_score"] for x in r["results"]), reverse=True)
        for x in r["results"]:
            assert "document" not in x
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefix + query shared


def test_score_endpoint(score_server, model_dirs, tok):
    want = _reference_scores(model_dirs, tok, "q", TEXTS[:3], "judge it")
    r = httpx.post(f"{score_server.url}/v1/score", timeout=60, json={
        "text_1": "q", "text_2": TEXTS[:3], "instruction": "judge it"}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2]
    for d in r["data"]:
        assert abs(d["score"] - want[d["index"]]) < 1e-4
    bad = httpx.post(f"{score_server.url}/v1/score", timeout=60, json={
        "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code in (400, 422)


def test_generative_model_serves_demo_embeddings(model_dirs, hf, tok):
    srv, engine = _serve(model_dirs[0])
    with srv:
        assert engine.pooling.task == "generate" and engine.pooling.rule.method == "mean"
        r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS[:2]}, timeout=60)
        for text, d in zip(TEXTS[:2], r.json()["data"], strict=True):
            close(d["embedding"], ref(hf, tok, text, method="mean"))
        refused = httpx.post(f"{srv.url}/v1/rerank", json={"query": "a", "documents": ["b"]},
                             timeout=60)
        assert refused.status_code == 400 and "--task" in refused.json()["error"]["message"]
