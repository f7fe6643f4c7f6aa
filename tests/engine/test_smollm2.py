"""The real embedded model: greedy tokens identical to HF transformers on the same weights
(``quantization="none"``, the exact-reference path); with its Q4_1/Q8_0 weights kept packed
(``quantization="auto"``), teacher-forced top-1 agreement with HF on >= 95% of positions, and perplexity within 1% of
the exact path; quantised on load (``int4``: 4-bit projections and an 8-bit token table/head;
``int8``) from those float weights, the same agreement and perplexity within 3%."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from loadgen.teacher_forced import (
    TEXT,
    continuation_hits,
    forced,
    perplexity,
    perplexity_of,
)

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
    prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
    hits, total = continuation_hits(llm, [(p, hf_greedy(hf, p, 24)) for p in prompts])
    assert hits / total >= 0.95, f"top-1 agreement {hits}/{total}"


@pytest.fixture(scope="module")
def hf_continuations(smollm2_files, llm):
    """(prompt ids, HF's greedy 24 tokens) per prompt of PROMPTS."""
    hf = load_hf(smollm2_files.path)
    prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
    return [(p, hf_greedy(hf, p, 24)) for p in prompts]


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantised_on_load_agrees_with_hf(llm, hf_continuations, scheme):
    """The embedded model's dequantised (float) weights quantised on load. Its projections come
    from Q4_1 and its table from Q8_0, so int4's groups of 32 re-find much of the source grid;
    still a trained model, where a wrong row, scale or nibble order would show at once."""
    q = LLM(None, kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=16,
            quantization=scheme)
    assert q.engine.runner.quantized
    # The float engine holds its float32 weights once (batch-invariant serving frees the oneDNN
    # copies), ~4 bytes a weight; int8 groups of 32 take ~1.1, int4 ~0.6.
    assert q.engine.runner.weight_bytes < llm.engine.runner.weight_bytes / 4
    hits, total = continuation_hits(q, hf_continuations)
    assert hits / total >= 0.95, f"top-1 agreement {hits}/{total}"
    ids = llm.tokenizer.encode(TEXT)
    exact, approx = perplexity(llm, ids), perplexity(q, ids)
    assert abs(approx / exact - 1) <= 0.03, f"perplexity {approx:.3f} vs exact {exact:.3f}"


def test_default_pairing_packed_weights_and_float16_kv_within_one_percent(llm, monkeypatch):
    """The server's default pairing on a CPU (issue 32 item 3): the GGUF's 4-bit weights kept
    packed (their one approximation: int8 activations per group of 32) and a float16 KV
    cache, against the exact path (float32 everywhere): perplexity within 1% and top-1
    agreement >= 96% (measured: see docs/decisions.md#weights-and-kv-together). Prefill in
    chunks of 16 rows so that every row goes through the packed kernels and reads the float16
    cache, as decode does (larger chunks dequantise panels: exact).

    On 455 tokens (this text and the KV calibration text): the int8 rounding of activations
    makes each position's log-prob wander (~0.1 nat) with float-rounding-level changes upstream
    (attention summed in another order), so a 172-token estimate alone swings by ~1%
    (measured +0.03% and +1.15% for two attention paths equal to 1e-7); 455 tokens: +0.07% /
    +0.53%."""
    from engine.kv_format.calibration import CALIBRATION_TEXT

    monkeypatch.setenv("KVSERVE_QUANT_FORCE", "1")
    packed = LLM(None, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
                 max_num_batched_tokens=16, quantization="auto", kv_cache_dtype="float16")
    assert packed.engine.runner.quantized
    ids = llm.tokenizer.encode(TEXT + "\n\n" + CALIBRATION_TEXT)
    ref, got = forced(llm, ids), forced(packed, ids)
    agreement = sum((a == 1) == (b == 1) for (a, _), (b, _) in zip(ref, got)) / len(ref)
    exact, approx = perplexity_of(ref), perplexity_of(got)
    assert abs(approx / exact - 1) <= 0.01, f"perplexity {approx:.3f} vs exact {exact:.3f}"
    assert agreement >= 0.96, f"top-1 agreement {agreement:.1%}"


def test_faithful_activations_answer_like_the_float_model(llm):
    """``--activation-precision float32`` (``auto``'s choice where the faithful kernel is
    within its margin, as on AVX-512: docs/models.md#activation-precision): the packed weights
    times float32 activations over the served float16 KV pool agree with the exact path on
    >= 98.5% of 455 teacher-forced positions (held-out text measured 100%), and answer the
    README's question as the float model does (int8 activations tip its near-tie to "L")."""
    from engine.kv_format.calibration import CALIBRATION_TEXT
    from engine.quantization.activation import packed_modules

    faithful = LLM(None, kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=16,
                   activation_precision="float32")
    parts = [p for m in packed_modules(faithful.engine.runner.model)
             for p in getattr(m, "parts", [m])]
    assert parts and all(p.kernels.activation == "float32" for p in parts)
    ids = llm.tokenizer.encode(TEXT + "\n\n" + CALIBRATION_TEXT)
    ref, got = forced(llm, ids), forced(faithful, ids)
    agreement = sum((a == 1) == (b == 1) for (a, _), (b, _) in zip(ref, got)) / len(ref)
    assert agreement >= 0.985, f"top-1 agreement {agreement:.1%}"
    out = faithful.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.outputs[0].text.startswith("The capital of France is Paris")


@pytest.mark.parametrize("kind,min_agreement,max_delta", [
    ("int8", 0.98, 0.01), ("fp8_e4m3", 0.98, 0.02), ("float16", 0.98, 0.002),
    ("bfloat16", 0.98, 0.005), ("int4", 0.93, 0.06)])
def test_quantised_kv_cache_agreement_and_perplexity(llm, kind, min_agreement, max_delta):
    """8-bit, 4-bit and 16-bit KV against the exact (float32) cache on the real model (issue
    13's targets): teacher-forced top-1 agreement >= 98% and perplexity within 1% (int8) / 2%
    (fp8, calibrated) / 0.2% (float16) / 0.5% (bfloat16; measured: -0.00% and -0.01%); int4
    (issue 32; measured on these 210 tokens: 95.2-97.1% and +2.4-4.4% across runs that differ
    only in float rounding) >= 93% and within 6%. Prefill
    in chunks of 16 so that every chunk after the first attends over the narrow cache, as
    decode does (a whole prompt attends over its own exact K/V)."""
    exact = LLM(None, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
                max_num_batched_tokens=16, quantization="none")
    quant = LLM(None, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
                max_num_batched_tokens=16, quantization="none", kv_cache_dtype=kind,
                calculate_kv_scales=kind.startswith("fp8"))
    ids = llm.tokenizer.encode(TEXT)
    for prompt in PROMPTS:
        ids += llm.tokenizer.encode(" " + prompt)
    ref, got = forced(exact, ids), forced(quant, ids)  # one prefill each: ranks and log-probs
    agreement = sum((a == 1) == (b == 1) for (a, _), (b, _) in zip(ref, got)) / len(ref)
    assert agreement >= min_agreement, f"{kind}: top-1 agreement {agreement:.1%}"
    assert abs(perplexity_of(got) / perplexity_of(ref) - 1) <= max_delta
