"""Gemma 2 and Gemma 3 text models against HF transformers on tiny random weights.

The tiny configs (``engine.loading.tiny``) set every Gemma scalar away from its default: a
window of 8 (prompts up to 40 tokens), query_pre_attn_scalar 24 with head_dim 32, one KV head,
Gemma 2's soft-caps at 5 (attention) and 3 (logits), Gemma 3's local RoPE base 500 and linear
scaling x2 on its global layers, random (1 + w) norm scales, tied embeddings.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir, tiny_config
from engine.models.layer_ops import layer_ops_for
from engine.models.registry import build_model
from tests.engine.models.test_model_forward import _meta

GEMMAS = ["gemma2", "gemma3_text"]


@pytest.mark.parametrize("model_type", GEMMAS)
def test_logits_match_hf(model_type):
    """Prefill of 21 tokens (window 8), then decodes through a shuffled paged table, with the
    PyTorch and the fused CPU layer ops."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    ours = build_model(hf.config).eval()
    ours.load_weights(hf.state_dict().items())
    a = ours.arch
    n = 21
    ids = torch.randint(0, config.vocab_size, (n,))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
    table = [5, 2, 7, 0, 3, 6]
    backend = TorchAttentionBackend()
    shape = (8, 4, a.num_kv_heads, a.head_dim)
    for ops in {type(o): o for o in (ours.ops, layer_ops_for(torch.device("cpu"),
                                                             torch.float32))}.values():
        with torch.inference_mode():
            kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.num_layers)]
            h = ours(ids, torch.arange(n), kv, _meta(0, n, table), backend, ops)
            torch.testing.assert_close(ours.compute_logits(h), ref, rtol=1e-4, atol=1e-4)
            kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.num_layers)]
            h = ours(ids[:15], torch.arange(15), kv, _meta(0, 15, table), backend, ops)
            got = [ours.compute_logits(h)[-1]]
            for pos in range(15, n):
                h = ours(ids[pos:pos + 1], torch.tensor([pos]), kv, _meta(pos, 1, table),
                         backend, ops)
                got.append(ours.compute_logits(h)[0])
            torch.testing.assert_close(torch.stack(got), ref[14:], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=GEMMAS)
def tiny_gemma(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    rng = random.Random(GEMMAS.index(request.param))
    shared = [rng.randrange(0, 256) for _ in range(14)]  # prefix-cache hits across requests
    prompts = [([*shared] if i % 2 else []) + [rng.randrange(0, 256)
                                               for _ in range(rng.randint(3, 26))]
               for i in range(6)]
    lengths = [rng.randint(4, 10) for _ in prompts]
    hf = load_hf(path)
    return path, prompts, lengths, [hf_greedy(hf, p, k) for p, k in zip(prompts, lengths)]


def _generate(llm: LLM, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_matches_hf(tiny_gemma):
    """Concurrent requests longer than the window, prefix caching on (every other prompt
    shares a 14-token prefix), chunked prefill (24-token budget), quantization=none, float32."""
    path, prompts, lengths, expected = tiny_gemma
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              quantization="none", enable_prefix_caching=True, max_num_batched_tokens=24)
    assert _generate(llm, prompts, lengths) == expected
    assert llm.stats()["prefix_cache_hits"] > 0
    llm.engine.kv.check_integrity()


def test_gemma2_is_served_by_every_backend():
    """Both backends soft-cap (the Triton kernels: tests/kernels/test_paged_decode.py), so no
    backend is refused for Gemma 2."""
    model = build_model(tiny_config("gemma2"))
    assert model.arch.attn_softcap and not hasattr(model, "attention_backend_refusal")


def test_multimodal_checkpoint_names_load_text_model():
    """A Gemma3ForConditionalGeneration checkpoint's text weights (both HF spellings) load;
    vision tensors are skipped."""
    torch.manual_seed(0)
    config = tiny_config("gemma3_text")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = hf.state_dict()
    ref = build_model(config)
    ref.load_weights(state.items())
    for prefix, head in (("model.language_model.", "lm_head."),
                         ("language_model.model.", "language_model.lm_head.")):
        renamed = [(head + k.removeprefix("lm_head.") if k.startswith("lm_head.")
                    else prefix + k.removeprefix("model."), v) for k, v in state.items()]
        renamed.append(("vision_tower.vision_model.embeddings.patch_embedding.weight",
                        torch.zeros(3)))
        ours = build_model(config)
        ours.load_weights(renamed)
        for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q), name


@pytest.mark.slow  # ~10 s in the Triton interpreter on two cores
def test_gemma3_on_the_triton_kernels():
    """Gemma 3 (head_dim 256, one KV head, query_pre_attn_scalar 24, window 8) through the
    Triton backend's kernels (interpreted on a CPU): prefill then decodes equal HF's logits."""
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    config = tiny_config("gemma3_text", head_dim=256, num_attention_heads=2,
                         num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ours = build_model(hf.config).eval()
    ours.load_weights(hf.state_dict().items())
    a, n, table = ours.arch, 17, [5, 2, 7, 0, 3]
    ids = torch.randint(0, config.vocab_size, (n,))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
    backend = TritonAttentionBackend()
    shape = (8, 4, a.num_kv_heads, a.head_dim)
    with torch.inference_mode():
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.num_layers)]
        h = ours(ids[:15], torch.arange(15), kv, _meta(0, 15, table), backend)
        got = [ours.compute_logits(h)[-1]]
        for pos in range(15, n):
            h = ours(ids[pos:pos + 1], torch.tensor([pos]), kv, _meta(pos, 1, table), backend)
            got.append(ours.compute_logits(h)[0])
    torch.testing.assert_close(torch.stack(got), ref[14:], rtol=1e-4, atol=1e-4)
