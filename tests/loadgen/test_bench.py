"""`kvserve bench`: statistics, FLOPs yardstick and workloads against independent counts (fast),
and the bench commands driving the real kvserve server on loopback (slow).

Truths: numpy's percentiles; a brute-force FLOPs sum; the server's own usage reports and its
/metrics token counters; the HTTP status of requests the server must refuse.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from loadgen.client import BenchClient, ClientConfig
from loadgen.kv_calc import ModelShape, resolve_shape
from loadgen.stats import (
    Distribution,
    RequestRecord,
    format_summary,
    percentile,
    summarize,
)
from loadgen.workloads import (
    PromptMaker,
    WorkloadConfig,
    build_sessions,
    load_tokenizer,
    poisson_arrivals,
    tools_text,
)
from loadgen.yardstick import request_flops, run_flops

SMALL = ModelShape("t", layers=3, heads=4, kv_heads=2, head_dim=8, hidden=32, intermediate=64,
                   vocab=100)
OPENAI_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "n",
                            "stop", "top_p", "seed", "logprobs", "echo", "suffix", "user",
                            "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
                            "stream_options"}


# ----------------------------------------------------------------------------- fast


def test_percentiles_match_numpy_and_are_ordered():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
        d = Distribution.of_seconds(xs)
        assert d.min <= d.p50 <= d.p90 <= d.p99 <= d.max
        assert d.min <= d.mean <= d.max and d.n == n
    assert Distribution.of_seconds([]).n == 0


def test_request_flops_equal_a_brute_force_count():
    n_params = SMALL.non_embedding_params()
    for prompt, out, cached in ((5, 1, 0), (7, 4, 0), (20, 6, 16), (3, 0, 0)):
        dense = logits = attn = 0.0
        # Feed every token the model actually computes: uncached prompt, then outputs but last.
        processed = list(range(cached, prompt)) + list(range(prompt, prompt + out - 1))
        for pos in processed:
            dense += 2 * n_params
            attn += 4 * SMALL.layers * (pos + 1) * SMALL.heads * SMALL.head_dim
        logits = 2 * SMALL.hidden * SMALL.vocab * out
        f = request_flops(SMALL, prompt, out, cached)
        assert (f.dense, f.logits, f.attention) == pytest.approx((dense, logits, attn))
    assert run_flops(SMALL, [(5, 1, 0), (7, 4, 0)]).total == pytest.approx(
        request_flops(SMALL, 5, 1).total + request_flops(SMALL, 7, 4).total)


class _CharTokenizer:
    """One token per character: an independent, exactly additive tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_workloads_have_the_asked_shape():
    tok = _CharTokenizer()
    sessions = build_sessions(WorkloadConfig("random", num_requests=5, input_len=40,
                                             output_len=3, seed=1), tok)
    assert [s.turns[0].prompt.token_ids == tok.encode(s.turns[0].prompt.text)
            for s in sessions] == [True] * 5
    assert all(len(s.turns[0].prompt.token_ids) == 40 for s in sessions)
    assert len({tuple(s.turns[0].prompt.token_ids) for s in sessions}) == 5

    shared = build_sessions(WorkloadConfig("shared-prefix", num_requests=6, input_len=10,
                                           output_len=2, prefix_len=32, num_groups=2), tok)
    ids = [s.turns[0].prompt.token_ids for s in shared]
    assert all(len(i) == 42 for i in ids)
    assert ids[0][:32] == ids[2][:32] == ids[4][:32] != ids[1][:32]
    assert len({tuple(i[32:]) for i in ids}) == 6

    copies = build_sessions(WorkloadConfig("copy", num_requests=3, input_len=30, output_len=5),
                            tok)
    for s in copies:
        ids = s.turns[0].prompt.token_ids
        assert len(ids) == 30 and ids[20:] == ids[:10]  # a passage of 20, its first 10 again

    chats = build_sessions(WorkloadConfig("multi-turn", num_requests=7, num_turns=3), None)
    assert [len(s.turns) for s in chats] == [3, 3, 1] and all(s.chat for s in chats)
    # The same seed gives the same prompts; the word fallback sizes prompts in words.
    again = PromptMaker(None, 5).make(12)
    assert again.text == PromptMaker(None, 5).make(12).text and len(again.text.split()) == 12


@pytest.fixture(scope="module")
def smol_tok():
    """The embedded model's tokenizer: the one the agent workload is sized with by default."""
    return load_tokenizer(None)


def _agent_requests(session) -> list[dict]:
    """Each turn's chat request body as run_point sends it: the conversation so far."""
    messages, bodies = [], []
    for turn in session.turns:
        messages = messages + turn.messages
        bodies.append({"model": "m", "messages": messages, "tools": session.tools,
                       "tool_choice": session.tool_choice, "max_tokens": turn.max_tokens,
                       "stream": True, "logprobs": True})
    return bodies


def test_agent_workload_shape_and_determinism(smol_tok):
    import jsonschema

    from server.protocol import ChatCompletionRequest

    cfg = WorkloadConfig("agent", num_requests=8, num_turns=3, input_len=20, output_len=4,
                         tool_result_len=60, seed=3)
    sessions = build_sessions(cfg, smol_tok)
    assert [len(s.turns) for s in sessions] == [3, 3, 2] and all(s.chat for s in sessions)
    tools = sessions[0].tools
    # The shared prefix: every conversation sends the same tools, ~2,000 tokens of JSON.
    assert all(s.tools == tools and s.tool_choice == "auto" for s in sessions)
    assert len(tools) >= 4 and len({t["function"]["name"] for t in tools}) == len(tools)
    size = len(smol_tok.encode(tools_text(tools)))
    assert sessions[0].tools_tokens == size and 1700 <= size <= 2300
    assert any(p["type"] == "object" for t in tools
               for p in t["function"]["parameters"]["properties"].values())  # nested
    # The same seed gives the same workload; another seed other tools and tasks.
    dump = json.dumps([[t.messages for t in s.turns] for s in sessions])
    assert dump == json.dumps([[t.messages for t in s.turns]
                               for s in build_sessions(cfg, smol_tok)])
    other = build_sessions(WorkloadConfig(**{**vars(cfg), "seed": 4}), smol_tok)
    assert other[0].tools != tools
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for s in sessions:
        first = s.turns[0].messages
        assert [m["role"] for m in first] == ["system", "user"]
        assert len({s2.turns[0].messages[1]["content"] for s2 in sessions}) == len(sessions)
        for k, turn in enumerate(s.turns[1:], 1):
            call, result = turn.messages
            [tc] = call["tool_calls"]
            assert call["role"] == "assistant" and result["role"] == "tool"
            assert tc["id"] == result["tool_call_id"] == f"call_{s.index}_{k}"
            jsonschema.validate(json.loads(tc["function"]["arguments"]),
                                by_name[tc["function"]["name"]])
            assert len(smol_tok.encode(result["content"])) == pytest.approx(62, abs=2)
        for body in _agent_requests(s):  # what the chat endpoint accepts, tools and history
            req = ChatCompletionRequest.model_validate(body)
            assert req.tool_set.choice == "auto" and len(req.tool_set.tools) == len(tools)


def test_agent_prompts_grow_by_their_turn_on_kvserve_and_the_llamacpp_template(smol_tok):
    """kvserve's default tool prompt makes each turn's prompt the previous one plus the new
    messages (the prefix cache's case), and benchmarks/chatml_tools.jinja, which llama-server
    gets in benchmarks/agents_vs_llamacpp.py, renders exactly the same text."""
    from engine.chat_template import render_chat
    from server.protocol import ChatCompletionRequest
    from server.tools.formats import HERMES
    from server.tools.prompt import tool_conversation

    template = (Path(__file__).resolve().parents[2] / "benchmarks" /
                "chatml_tools.jinja").read_text()
    [session] = build_sessions(WorkloadConfig("agent", num_requests=3, num_turns=3,
                                              input_len=20, output_len=4, tool_result_len=40,
                                              tools_len=300, seed=1), smol_tok)
    previous = None
    for body in _agent_requests(session):
        req = ChatCompletionRequest.model_validate(body)
        msgs, kwargs = tool_conversation(req.conversation(), req.tool_set.openai_tools(),
                                         HERMES, native=False)
        text, ids = render_chat(smol_tok.tok, msgs, add_generation_prompt=True,
                                template_kwargs=kwargs)
        theirs = smol_tok.tok.apply_chat_template(body["messages"], tools=body["tools"],
                                                  chat_template=template, tokenize=False,
                                                  add_generation_prompt=True)
        assert theirs == text
        if previous is not None:  # the last prompt, its assistant opening included
            assert text.startswith(previous) and len(text) > len(previous)
        previous = text


def test_poisson_arrivals():
    assert poisson_arrivals(4, None, 0) == [0.0] * 4
    times = poisson_arrivals(2000, 10.0, 3)
    assert times == sorted(times) and times[0] == 0.0
    assert np.mean(np.diff(times)) == pytest.approx(0.1, rel=0.1)


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def _run_client(handler, openai_only=False, chat=False):
    seen = []

    def capture(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return handler(request)

    async def go():
        cfg = ClientConfig("http://127.0.0.1:1", "m", openai_only=openai_only, timeout=5)
        async with BenchClient(cfg, transport=httpx.MockTransport(capture)) as c:
            if chat:
                return await c.chat([{"role": "user", "content": "hi"}], 3)
            return await c.complete("hi", 3, expected_prompt_tokens=1)

    return asyncio.run(go()), seen


def test_client_counts_tokens_and_usage():
    def ok(_req):
        body = _sse({"choices": [{"index": 0, "text": "a"}]},
                    {"choices": [{"index": 0, "text": ""}]},  # held-back text: no token
                    {"choices": [{"index": 0, "text": "b",
                                  "logprobs": {"tokens": ["b", "c"]}}]},
                    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": 0}}},
                    "[DONE]")
        return httpx.Response(200, content=body)

    rec, seen = _run_client(ok)
    assert rec.ok and rec.text == "ab" and rec.stream_tokens == 3 and rec.output_tokens == 3
    assert rec.usage_completion_tokens == 3 and rec.prompt_tokens == 1
    assert rec.finish_reason == "length" and len(rec.itl) == 1 and rec.ttft is not None
    assert seen[0]["ignore_eos"] is True and seen[0]["stream_options"]["include_usage"]


def test_client_openai_only_sends_only_openai_fields_and_counts_the_stream():
    def ok(_req):
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"choices": [{"index": 0, "delta": {"content": "x"}}]},
            {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}]},
            "[DONE]"))

    rec, seen = _run_client(ok, openai_only=True, chat=True)
    assert rec.ok and rec.output_tokens == rec.stream_tokens == 2 and rec.text == "xy"
    assert rec.usage_completion_tokens is None
    assert set(seen[0]) <= OPENAI_COMPLETION_FIELDS | {"messages"}
    assert "ignore_eos" not in seen[0] and "stream_options" not in seen[0]


def test_client_agent_turns_ask_for_logprobs_or_time_the_first_chunk():
    def handler(_req):
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
            {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"token": "<"}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 8}}},
            "[DONE]"))

    tools = [{"type": "function", "function": {"name": "f"}}]

    async def go(first_chunk: bool):
        seen = []

        def capture(request):
            seen.append(json.loads(request.content))
            return handler(request)

        cfg = ClientConfig("http://127.0.0.1:1", "m", timeout=5, ttft_first_chunk=first_chunk)
        async with BenchClient(cfg, transport=httpx.MockTransport(capture)) as c:
            return await c.chat([{"role": "user", "content": "hi"}], 3, tools=tools,
                                tool_choice="auto"), seen[0]

    rec, body = asyncio.run(go(False))
    assert rec.ok and rec.ttft is not None and rec.stream_tokens == 1  # the logprob chunk
    assert (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens) == (9, 8, 2)
    assert body["tools"] == tools and body["tool_choice"] == "auto" and body["logprobs"]
    assert "ignore_eos" not in body  # a turn may end with its call
    rec2, body2 = asyncio.run(go(True))
    assert rec2.ok and rec2.ttft is not None and "logprobs" not in body2


def test_summary_per_turn():
    recs = [RequestRecord(ok=True, start=0.0, end=1.0, ttft=t, prompt_tokens=p,
                          cached_tokens=c, output_tokens=2, turn=k)
            for k, t, p, c in ((0, 0.4, 100, 0), (0, 0.2, 100, 96), (1, 0.1, 150, 96))]
    recs.append(RequestRecord(ok=False, start=0.0, end=0.0, turn=1, error="x"))
    s = summarize(recs, 1.0, "x", {})
    [t0, t1] = s.per_turn
    assert (t0["completed"], t0["failed"], t1["completed"], t1["failed"]) == (2, 0, 1, 1)
    assert t0["ttft_ms"]["p50"] == pytest.approx(300.0) and s.turn_ttft_p50()[1] == 100.0
    assert (t0["prompt_tokens_mean"], t0["cached_tokens_mean"]) == (100, 48)
    assert "Per turn" in format_summary(s)
    assert summarize(recs[:2], 1.0, "x", {}).per_turn is None  # one turn: no table


@pytest.mark.parametrize("response, why", [
    (httpx.Response(400, json={"error": {"message": "too long"}}), "HTTP 400: too long"),
    (httpx.Response(200, content=_sse({"error": {"message": "boom"}})), "stream error: boom"),
    (httpx.Response(200, content=_sse({"choices": [{"index": 0, "text": "a"}]})),
     "without a finish_reason"),
])
def test_client_records_failures(response, why):
    rec, _ = _run_client(lambda _req: response)
    assert not rec.ok and why in rec.error
    s = summarize([rec], 1.0, "x", {})
    assert s.failed == 1 and s.completed == 0 and s.output_tokens == 0


def test_summary_counts_only_successes():
    recs = [RequestRecord(ok=True, start=0.0, end=1.0, ttft=0.2, itl=[0.1, 0.3],
                          output_tokens=3, prompt_tokens=5),
            RequestRecord(ok=False, start=0.0, end=0.1, error="HTTP 500: x")]
    s = summarize(recs, 2.0, "x", {})
    assert (s.completed, s.failed, s.output_tokens, s.prompt_tokens) == (1, 1, 3, 5)
    assert s.tpot_ms.mean == pytest.approx(400.0) and s.output_throughput == 1.5
    assert s.errors == ["HTTP 500: x"]


# ----------------------------------------------------------------------------- slow: real server


def _bench(real_server, tmp_path, *extra: str, name: str = "run") -> tuple[int, dict]:
    from server.cli import main

    out = tmp_path / f"{name}.json"
    rc = main(["bench", "serve", "--base-url", real_server.url, "--model", "smol-e2e",
               "--api-key", "e2e-key", "--model-config", "SmolLM2-135M-Instruct",
               "--no-progress", "--warmup", "0", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def _generated(real_server) -> float:
    from tests.server.helpers import sample, scrape

    return sample(scrape(real_server.url, real_server.headers),
                  "kvserve:request_generation_tokens_sum")


def _ordered(d: dict) -> bool:
    return d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]


@pytest.mark.slow
def test_bench_serve_figures_agree_with_the_server(real_server, tmp_path):
    before = _generated(real_server)
    # --peak-dtype float32: the yardstick's probe (timed twice, before and after the run) on
    # one dtype instead of two; what the test checks is the accounting, not the peak.
    rc, res = _bench(real_server, tmp_path, "--num-requests", "6", "--input-len", "24",
                     "--output-len", "5", "--concurrency", "1,3", "--seed", "7",
                     "--peak-dtype", "float32", "--plot", str(tmp_path / "plots"))
    assert rc == 0 and len(res["runs"]) == 2
    for run in res["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["prompt_tokens"] == 6 * 24  # the server's usage = the tokens we made
        assert run["output_tokens"] == 6 * 5  # ignore_eos: exactly max_tokens each
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert _ordered(run[key]), key
        assert run["ttft_ms"]["max"] <= run["e2e_ms"]["max"]
        assert run["itl_ms"]["n"] <= 6 * 4
        eff = run["efficiency"]
        shape = resolve_shape(None)
        assert eff["useful_gflop"] * 1e9 == pytest.approx(6 * request_flops(shape, 24, 5).total)
        assert 0 < eff["efficiency"] and eff["peak_gflops"] > 0
    # The server's own counter of generated tokens moved by exactly what the bench reports.
    assert _generated(real_server) - before == sum(r["output_tokens"] for r in res["runs"])
    assert (tmp_path / "plots" / "throughput_tpot_vs_concurrency.png").read_bytes()[:4] == \
        b"\x89PNG"


@pytest.mark.slow
def test_bench_serve_shared_prefix_multi_turn_and_openai_only(real_server, tmp_path):
    rc, res = _bench(real_server, tmp_path, "--workload", "shared-prefix", "--prefix-len",
                     "32", "--num-groups", "2", "--num-requests", "4", "--input-len", "8",
                     "--output-len", "2", "--concurrency", "1", "--no-yardstick", name="prefix")
    [run] = res["runs"]
    assert rc == 0 and run["completed"] == 4 and run["prompt_tokens"] == 4 * 40
    assert run["cached_tokens"] == 2 * 32  # the second request of each group hits the prefix

    rc, res = _bench(real_server, tmp_path, "--workload", "multi-turn", "--num-requests", "4",
                     "--num-turns", "2", "--input-len", "8", "--output-len", "3",
                     "--request-rate", "20", "--no-yardstick", name="chat")
    [run] = res["runs"]
    assert rc == 0 and run["completed"] == 4 and run["output_tokens"] == 12
    assert run["prompt_tokens"] > 4 * 8 + 2 * 3  # later turns resend the conversation

    before = _generated(real_server)
    rc, res = _bench(real_server, tmp_path, "--openai-only", "--num-requests", "3",
                     "--input-len", "16", "--output-len", "4", "--no-yardstick", name="openai")
    [run] = res["runs"]
    assert rc == 0 and run["completed"] == 3 and run["output_tokens"] <= 12
    # Counted from the stream alone; at most one EOS token per request is in the server's count.
    assert 0 <= _generated(real_server) - before - run["output_tokens"] <= 3


@pytest.mark.slow
def test_bench_serve_sends_prompt_token_ids(real_server, tmp_path):
    """``--prompt-token-ids``: completions prompts go as the tokenizer's ids (for two servers
    whose tokenisers of one file differ); the server counts exactly those tokens."""
    rc, res = _bench(real_server, tmp_path, "--prompt-token-ids", "--num-requests", "3",
                     "--input-len", "16", "--output-len", "2", "--seed", "11",
                     "--no-yardstick", name="ids")
    [run] = res["runs"]
    assert rc == 0 and res["prompt_token_ids"] is True
    assert run["completed"] == 3 and run["prompt_tokens"] == 3 * 16


@pytest.mark.slow
def test_bench_serve_agent_workload(real_server, tmp_path):
    """Two agents, two turns each, against the real server: every turn is accepted with its
    tools and history, the second turn finds the first one's prompt in the prefix cache."""
    rc, res = _bench(real_server, tmp_path, "--workload", "agent", "--num-requests", "4",
                     "--num-turns", "2", "--tools-len", "300", "--tool-result-len", "40",
                     "--input-len", "16", "--output-len", "4", "--concurrency", "2",
                     "--seed", "3", "--no-yardstick", name="agent")
    [run] = res["runs"]
    assert rc == 0 and (run["completed"], run["failed"]) == (4, 0)
    assert run["params"]["tool_choice"] == "auto" and run["ttft_ms"]["n"] == 4
    t0, t1 = run["per_turn"]
    assert t0["completed"] == t1["completed"] == 2
    assert 300 < t0["prompt_tokens_mean"] < t1["prompt_tokens_mean"] < 700
    # Turn 1 resends turn 0's prompt: all its full blocks (16 tokens) are cache hits.
    assert t1["cached_tokens_mean"] >= t0["prompt_tokens_mean"] - 16


@pytest.mark.slow
def test_bench_serve_counts_failures(real_server, tmp_path):
    rc, res = _bench(real_server, tmp_path, "--num-requests", "3", "--input-len", "1100",
                     "--output-len", "2", "--tokenizer", "none", "--no-yardstick")
    [run] = res["runs"]
    assert rc == 1  # the exit status says some requests failed
    assert (run["completed"], run["failed"]) == (0, 3)
    assert run["errors"] and all("HTTP 400" in e for e in run["errors"])
    assert run["output_tokens"] == 0 and run["ttft_ms"]["n"] == 0


@pytest.mark.slow
def test_bench_offline_against_its_baselines(tmp_path):
    """A tiny random Llama: kvserve, HF and recompute agree on the greedy tokens; the sweeps
    report what the engine did (prefix hits only with caching on)."""
    from engine.loading.tiny import make_tiny_model_dir
    from server.cli import main

    model = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(model), "--num-prompts", "3", "--input-len",
               "8", "--output-len", "4,6", "--concurrency", "1,3", "--prefix-sweep", "16,32",
               "--num-groups", "1", "--no-progress", "--json", str(out), "--plot",
               str(tmp_path / "plots")])
    res = json.loads(out.read_text())
    assert rc == 0 and [p["output_len"] for p in res["throughput"]] == [4, 6]
    for point in res["throughput"]:
        systems = {r["system"].split(" (")[0]: r for r in point["systems"]}
        assert set(systems) == {"kvserve LLM.generate", "HF transformers generate",
                                "kvserve, KV cache off"}
        assert all(r["output_tokens"] == 3 * point["output_len"] for r in systems.values())
        assert point["hf_greedy_agreement"] == 1.0  # same weights, greedy: same tokens
        assert point["recompute_greedy_agreement"] == 1.0
        assert point["speedup_vs_recompute"] > 0 and point["ratio_vs_hf"] > 0
    assert [r["params"]["concurrency"] for r in res["runs"]] == [1, 3]
    assert all(r["completed"] == 3 and r["output_tokens"] == 12 for r in res["runs"])
    hits = {(r["label"], r["params"]["prefix_len"]): r["cached_tokens"]
            for r in res["prefix_runs"]}
    # One group of 4 requests sent one by one: the last 3 find the whole prefix cached.
    assert hits == {("prefix caching on", 16): 3 * 16, ("prefix caching on", 32): 3 * 32,
                    ("prefix caching off", 16): 0, ("prefix caching off", 32): 0}
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["kv_cache_speedup_vs_length.png", "offline_throughput.png",
                     "throughput_tpot_vs_concurrency.png", "ttft_vs_prefix_len.png"]
