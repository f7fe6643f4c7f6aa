"""The real embedded model: greedy tokens identical to HF transformers on the same weights
(``quantization="none"``, the exact-reference path); with its Q4_1/Q8_0 weights kept packed
(``quantization="auto"``), teacher-forced top-1 agreement with HF on >= 95% of positions."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def llm(smollm2_files):
    return LLM(None, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048,
               quantization="none")


def test_greedy_matches_hf(smollm2_files, llm):
    hf = load_hf(smollm2_files.path)
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    prompts = [tok.encode(p) for p in [*PROMPTS, chat]]
    lengths = [24, 20, 16, 12, 24]
    expected = [hf_greedy(hf, p, k) for p, k in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    outs = llm.generate(prompts, params)  # all five concurrently in one engine
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[-1].outputs[0].text
    llm.engine.kv.check_integrity()


def test_chat_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_packed_weights_agree_with_hf(smollm2_files, monkeypatch):
    from engine.loading.embedded import embedded_gguf_path

    monkeypatch.setenv("KVSERVE_QUANT_FORCE", "1")  # the packed path, whatever the probe says
    llm = LLM(None, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
              quantization="auto")
    assert llm.engine.runner.quantized
    assert llm.engine.runner.weight_bytes <= 1.3 * embedded_gguf_path().stat().st_size
    hf = load_hf(smollm2_files.path)
    hits = total = 0
    for text in PROMPTS:
        prompt = llm.tokenizer.encode(text)
        ids = prompt + hf_greedy(hf, prompt, 24)
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=1))[0]
        for pos in range(len(prompt), len(ids)):
            total += 1
            hits += out.prompt_logprobs[pos][ids[pos]].rank == 1
    assert hits / total >= 0.95, f"top-1 agreement {hits}/{total}"
