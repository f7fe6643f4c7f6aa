"""``--quantization int4|int8`` on a float (HF) checkpoint.

A tiny random Llama (widths multiples of 128, so group sizes 32 and 128 both apply) is
quantised on load. Its truth is the float engine (``none``) on a copy of the checkpoint whose
weights were replaced by their round-to-nearest values (``quant_rtn.quantise``, checked against
the rounding's definition in tests/engine/quantization/test_quant_rtn.py; int4 keeps the token table and head
at int8, ``quant_apply.HEAD_SCHEMES``): the packed engine must match its teacher-forced top-1
tokens on >= 95% of positions (only the kernels' int8 activation rounding differs). Against the
unquantised float model a random, untrained model is no test of quality: 4-bit rounding
(7.8% relative weight error) flips most of its near-flat predictions. That comparison is made
on the trained embedded model in tests/engine/test_smollm2.py. ``auto`` leaves a float
checkpoint float.
"""

from __future__ import annotations

import itertools
import logging
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.quantization.linear import QuantEmbedding, QuantLinear, quant_kernels
from engine.quantization.rtn import quantise
from engine.weight_prep.apply import HEAD_SCHEMES
from loadgen.teacher_forced import continuation_hits

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")

PROMPTS = [list(b"hello world, "), list(b"The quick brown fox"), list(b"0123456789" * 5)]
FLOAT_BYTES = 4
CASES = [("int4", 32), ("int8", 32), ("int4", 128)]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("rtn")
    return make_tiny_model_dir(path, "llama", hidden_size=128, intermediate_size=256,
                               tie_word_embeddings=request.param)


def _rounded_copy(src, dst, scheme: str, group: int):
    """``src`` with every matrix replaced by its dequantised round-to-nearest value."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if t.dim() == 2:
            kind = HEAD_SCHEMES[scheme] if "embed" in name or "lm_head" in name else scheme
            tensors[name] = quantise(t, kind, group).dequantize().to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def references(model_dir, tmp_path_factory):
    """Greedy continuations of the float engine over each case's rounded weights."""
    out = {}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for scheme, group in CASES:
        path = _rounded_copy(model_dir, tmp_path_factory.mktemp("r") / "m", scheme, group)
        llm = _llm(path, "none")
        out[scheme, group] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    return out


def _llm(path, quantization: str, **kw) -> LLM:
    # batch_invariant=False: this measures the packed weights against HF/none with the dense
    # path's float panels, as test_quantized_engine does; batch-invariant serving runs prompts
    # on the int8-activation kernels, which flip near-tied top-1 tokens of a random model
    # (tests/engine/models/test_batch_invariance.py covers that mode).
    kw.setdefault("batch_invariant", False)
    return LLM(str(path), kv_cache_memory="16MiB", quantization=quantization, **kw)


def _agreement(llm: LLM, continuations) -> float:
    """Teacher-forced top-1 agreement with ``continuations``, each cut before its first id the
    tokenizer lacks (the model's 260 logits include ids a prompt may not hold)."""
    bound = llm.engine.token_id_bound
    hits, total = continuation_hits(llm, [
        (prompt, list(itertools.takewhile(lambda t: t < bound, cont)))
        for prompt, cont in zip(PROMPTS, continuations)])
    assert total >= 30  # enough positions survive the cut to mean something
    return hits / total


@pytest.mark.parametrize(("scheme", "group"), CASES)
def test_quantised_on_load_serves_packed(model_dir, references, scheme, group, caplog,
                                         default_quant_settings):
    default_quant_settings()  # a timing must not choose the numerics held to 95% agreement
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = _llm(model_dir, scheme, quantization_group_size=group)  # dtype auto: float32
    runner = llm.engine.runner
    assert runner.quantized and runner.dtype.is_floating_point and runner.dtype.itemsize == 4
    model = runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert all(isinstance(getattr(layer, attr), QuantLinear) for layer in model.layers
               for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert model.lm_head is None or isinstance(model.lm_head, QuantLinear)
    assert "Linear" not in {type(m).__name__ for m in model.modules()}
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    weights = sum(m.out_features * m.in_features for m in packed)
    head = model.embed_tokens.head if model.lm_head is None else model.lm_head
    assert head.is_q4 == (HEAD_SCHEMES[scheme] == "int4")
    for m in packed:  # values + float32 d (and m, 4-bit) per 32
        bits = 4 + 64 / 32 if m.is_q4 else 8 + 32 / 32
        assert m.nbytes == m.out_features * m.in_features * bits / 8
    # Resident: the packed weights plus norms and the rotary tables, far below float32's.
    assert runner.weight_bytes < weights * FLOAT_BYTES / 2.5
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"quantization={scheme} (round-to-nearest, groups of {group})" in m
               and "as requested" in m for m in messages)
    assert any(m.startswith("resident weights") and scheme in m for m in messages)
    assert _agreement(llm, references[scheme, group]) >= 0.95
    llm.engine.kv.check_integrity()


def test_auto_leaves_a_float_checkpoint_float(model_dir):
    llm = _llm(model_dir, "auto", dtype="float32")
    assert not llm.engine.runner.quantized
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding))
                   for m in llm.engine.runner.model.modules())


def test_int4_with_the_cpu_kernels_off_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    with pytest.raises(ValueError, match="CPU kernels off"):
        _llm(model_dir, "int4")
