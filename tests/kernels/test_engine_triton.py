"""The whole engine on the Triton backend (interpreted on CPU) gives the same greedy tokens as
on the PyTorch backend: tiny random Llama and Mistral (sliding window), concurrent prompts of
different lengths so that decodes, whole prompts and prefill chunks share steps; also over int8,
int4 and fp8 KV pools."""

from __future__ import annotations

import pytest

from tests.kernels.conftest import DEVICE

pytest.importorskip("triton")
from engine import LLM, SamplingParams  # noqa: E402
from engine.loading.tiny import make_tiny_model_dir  # noqa: E402

PROMPTS = [[7, 3, 250, 11, 42], list(range(40, 61)), [99], list(range(200, 213))]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,overrides,engine_overrides", [
    ("llama", {}, {"block_size": 8}),
    ("mistral", {"sliding_window": 6}, {"block_size": 4, "max_num_batched_tokens": 16}),
    # Hybrid KV cache: window and full layers read their own group's block tables.
    ("qwen2", {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 2,
               "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
     {"block_size": 4, "max_num_batched_tokens": 16}),
    # 8-bit pools: the Triton store/attention read the format the torch path writes.
    ("llama", {}, {"block_size": 8, "kv_cache_dtype": "int8", "max_num_batched_tokens": 16}),
    # int4: the backend rotates K/V/Q into the pool's basis and the output back.
    ("llama", {}, {"block_size": 8, "kv_cache_dtype": "int4", "max_num_batched_tokens": 16}),
    # Gemma 2: soft-capped scores in both Triton kernels (a window of 8 over longer prompts).
    ("gemma2", {}, {"block_size": 4, "max_num_batched_tokens": 16}),
    pytest.param("llama", {}, {"block_size": 8, "kv_cache_dtype": "fp8_e4m3"},
                 marks=pytest.mark.skipif(
                     DEVICE.type == "cpu", reason="the Triton interpreter's float -> fp8 cast "
                     "misrounds (tests/kernels/test_kv_quant_kernels.py); run on a GPU")),
])
def test_triton_backend_greedy_matches_torch_backend(tmp_path, model_type, overrides,
                                                     engine_overrides):
    path = make_tiny_model_dir(tmp_path / model_type, model_type, **overrides)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, dtype="float32", device=DEVICE.type,
                  kv_cache_memory="4MiB", **engine_overrides)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert all(len(t) == 4 for t in outputs["torch"])
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.slow
def test_triton_backend_speculative_greedy_matches_plain_torch(tmp_path):
    """Verification chunks (1 + k rows over the paged cache, after the decodes and before the
    prefills) through Triton's paged_attention: the same tokens as plain decoding."""
    path = make_tiny_model_dir(tmp_path / "llama", "llama", seed=2, initializer_range=0.05)
    prompts = [[5, 6, 5, 6, 5, 6, 5], list(range(40, 61)), [9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    common = dict(dtype="float32", device=DEVICE.type, kv_cache_memory="4MiB", block_size=4)
    plain = LLM(str(path), attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(str(path), attention_backend="triton", **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
