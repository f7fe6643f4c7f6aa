"""``quantization=auto`` on a tiny random Llama whose linears are Q5_0 / Q5_1 (llama-quantize's
fallback where rows are not multiples of 256) and IQ4_NL, and on one whose linears are all
Q2_K (a scale and a min per 16 on the 8-bit form), against ``none``.

``none`` dequantises every tensor exactly (gguf's own dequantiser); ``auto`` must keep every
one of these tensors packed (5-bit forms on their own kernel, IQ4_NL widened to 8 bits; Q/K/V
in one ``QuantConcat``) and agree with ``none`` teacher-forced on >= 95% of positions
(the int8 rounding of activations is the packed path's only approximation).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from loadgen.teacher_forced import continuation_hits

PROMPTS = [list(b"hello world, "), list(b"The quick brown fox"), list(b"0123456789" * 5)]
TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "IQ4_NL", "attn_output": "Q5_1",
         "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q5_0"}


PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _none_then_auto(path, cache, monkeypatch, default_quant_settings):
    """``none``'s greedy tokens for PROMPTS, then the ``auto`` engine (packed at every batch
    size, the default kernel settings) to hold against them."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    none = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", quantization="none")
    expected = [o.outputs[0].token_ids for o in none.generate(PROMPTS, PARAMS)]
    default_quant_settings()
    monkeypatch.setenv("KVSERVE_QUANT_FORCE", "1")
    # batch_invariant=False: this measures the packed weights against HF/none with the dense
    # path's float panels, as test_quantized_engine does; batch-invariant serving runs prompts
    # on the int8-activation kernels, which flip near-tied top-1 tokens of a random model
    # (tests/engine/models/test_batch_invariance.py covers that mode).
    # activation_precision="int8": the int8 kernels' kinds in the C++ decode stack (the
    # faithful default has no stack kind yet; tests/kernels/cpu/test_faithful_packed.py covers it).
    auto = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", quantization="auto",
               batch_invariant=False, activation_precision="int8")
    return expected, auto


@pytest.fixture(scope="module")
def q5_gguf(tmp_path_factory, make_llama_gguf):
    pytest.importorskip("gguf")
    from engine.quantization.linear import quant_kernels

    if quant_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    root = tmp_path_factory.mktemp("q5gguf")
    path = root / "tiny-llama.Q5_mix.gguf"
    make_llama_gguf(path, tied=True, quantised=True, linear_types=TYPES)
    return path, root / "cache"


def test_five_bit_and_iq4_tensors_load_packed_and_agree_with_none(q5_gguf, monkeypatch,
                                                                  default_quant_settings):
    from engine.quantization.linear import QuantConcat

    path, cache = q5_gguf
    expected, auto = _none_then_auto(path, cache, monkeypatch, default_quant_settings)
    model = auto.engine.runner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"QuantLinear", "QuantEmbedding"} <= kinds and "Linear" not in kinds
    for layer in model.layers:
        qkv = layer.qkv_proj
        assert isinstance(qkv, QuantConcat)  # Q5_0 and Q5_1 rows in one 5-bit run, then
        assert [p.is_q5 for p in qkv.parts] == [True, False]  # IQ4_NL's as 8-bit values
        assert qkv.parts[1].m is None and not qkv.parts[1].is_q4
        assert layer.o_proj.is_q5 and layer.gate_up_proj.is_q5 and layer.down_proj.is_q5
    assert model.decode_stack is not None  # the C++ layer stack takes the 5-bit kind too
    hits, total = continuation_hits(auto, zip(PROMPTS, expected))
    assert hits / total >= 0.95
    outs = auto.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert model.decode_stack.calls > 0
    auto.engine.kv.check_integrity()


def test_q2_k_tensors_load_packed_and_agree_with_none(tmp_path, make_llama_gguf, monkeypatch,
                                                       default_quant_settings):
    """Every projection Q2_K (a 256-wide model; encoded by tests/support/kquant_encode.py, read
    by gguf's own dequantiser for ``none``): served packed as 8-bit values with a scale and a
    min per 16, by the C++ decode stack too, agreeing with ``none`` teacher-forced."""
    pytest.importorskip("gguf")
    from engine.quantization.linear import quant_kernels

    if quant_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    path = tmp_path / "tiny-llama.Q2_K.gguf"
    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    make_llama_gguf(path, tied=True, quantised=True, linear_types=dict.fromkeys(roles, "Q2_K"))
    expected, auto = _none_then_auto(path, tmp_path / "cache", monkeypatch,
                                     default_quant_settings)
    model = auto.engine.runner.model
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            assert lin.qs.dtype == torch.int8 and lin.m is not None
            assert lin.d.shape[1] * 16 == lin.in_features  # a scale (and a min) per 16
    assert model.decode_stack is not None
    hits, total = continuation_hits(auto, zip(PROMPTS, expected))
    assert hits / total >= 0.95
    outs = auto.generate(PROMPTS, PARAMS)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert model.decode_stack.calls > 0
