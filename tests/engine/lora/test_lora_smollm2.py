"""LoRA on the real embedded model: a PEFT adapter of all seven projections on SmolLM2-135M,
greedy tokens on the exact path (``quantization="none"``) equal to HF + PEFT's merged model,
beside base rows in one batch; on the default packed path the adapter's rows agree with it
top-1 on most positions (the packed base's own quantisation error, not the adapter's)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from loadgen.teacher_forced import continuation_hits
from tests.engine.lora.peft_adapters import ALL_TARGETS, make_peft_adapter

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module")
def adapter(smollm2_files, tmp_path_factory):
    return make_peft_adapter(smollm2_files.path, tmp_path_factory.mktemp("smollm2-lora"), "tuned",
                             seed=5, r=8, alpha=16, targets=ALL_TARGETS, std=0.02)


def test_exact_path_equals_hf_peft_beside_base_rows(smollm2_files, adapter):
    llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory="128MiB",
              max_model_len=1024, enable_lora=True, lora_modules=[f"tuned={adapter.path}"])
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    hf = load_hf(smollm2_files.path)
    expected = [hf_greedy(adapter.merged, p, 16) for p in prompts] + [hf_greedy(hf, prompts[0], 16)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, lora_name="tuned")
              ] * len(prompts) + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    outs = llm.generate([*prompts, prompts[0]], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != expected[-1]  # the adapter changes the answer


def test_packed_path_agrees_with_hf_peft(adapter):
    llm = LLM(None, kv_cache_memory="128MiB", max_model_len=1024, enable_lora=True,
              lora_modules=[f"tuned={adapter.path}"])
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    hits, total = continuation_hits(
        llm, [(p, hf_greedy(adapter.merged, p, 16)) for p in prompts], lora_name="tuned")
    assert hits / total >= 0.85, f"top-1 agreement {hits}/{total}"
