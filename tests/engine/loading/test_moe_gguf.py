"""Mixture-of-experts GGUF files (engine/loading/tiny_gguf.py: a tiny Qwen3-MoE as ``qwen3moe``
and a tiny Mixtral as llama.cpp writes it, ``llama`` with experts; experts Q4_0/Q8_0) against
HF transformers' forward pass over the same quantised weights (dequantised by ``gguf``).

Teacher-forced over a fixed text: the engine's top-1 token equals HF's at >= 99.5% of
positions with ``quantization=none`` and >= 97% with the default ``auto`` (experts served
packed: only the routed experts' packed rows are computed). And the same models trained for a
few seconds on text (engine/loading/tiny_training.py): >= 97% in the default configuration as
served (batch-invariant: prompts on the 8-bit-activation kernels too), which the random
files' near-tied logits and router scores cannot hold (docs/performance.md#gguf-agreement-with-hf-next-to-llamacpp)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.tiny_gguf import write_moe_gguf
from engine.models.moe import PackedExperts
from loadgen.teacher_forced import TEXT


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_gguf(request, tmp_path_factory):
    from engine.cpu.kernels import load

    load()  # built (or found) under the usual cache dir, not again under the tests' temp one
    root = tmp_path_factory.mktemp(request.param)
    path = root / f"tiny-{request.param}.gguf"
    _, reference = write_moe_gguf(path, request.param)
    return path, root / "cache", reference


def _engine_top1(llm: LLM, ids: list[int]) -> list[int]:
    """The engine's top-1 token after each prefix ``ids[:p]``, ``p`` from 1 on."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    return [next(t for t, lp in out.prompt_logprobs[p].items() if lp.rank == 1)
            for p in range(1, len(ids))]


def _agreement(llm: LLM, reference) -> float:
    tok = llm.engine.tokenizer if hasattr(llm.engine, "tokenizer") else llm.get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)[:240]
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
    got = _engine_top1(llm, ids)
    return sum(a == b for a, b in zip(got, want)) / len(want)


def _llm(path, cache, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    # batch_invariant=False: this measures the packed weights against HF/none with the dense
    # path's float panels, as test_quantized_engine does; batch-invariant serving runs prompts
    # on the int8-activation kernels, which flip near-tied top-1 tokens of a random model
    # (tests/engine/models/test_batch_invariance.py covers that mode).
    kw.setdefault("batch_invariant", False)
    return LLM(str(path), dtype="float32", kv_cache_memory="8MiB", **kw)


def test_quantization_none_agrees_with_hf(moe_gguf, monkeypatch):
    path, cache, reference = moe_gguf
    llm = _llm(path, cache, monkeypatch, quantization="none")
    assert llm.engine.runner.model.moe_blocks()
    assert _agreement(llm, reference) >= 0.995


def test_auto_serves_packed_experts_and_agrees_with_hf(moe_gguf, monkeypatch):
    path, cache, reference = moe_gguf
    # The default quantization (auto) without the start-up probe: packed at every batch size
    # with the default kernel settings (on tiny shapes float may measure faster, and a timing
    # must not choose the numerics: see tests/conftest.py's default_quant_settings).
    llm = _llm(path, cache, monkeypatch, cpu_probe="off")
    blocks = llm.engine.runner.model.moe_blocks()
    assert blocks and all(isinstance(b.experts, PackedExperts) for b in blocks.values())
    assert _agreement(llm, reference) >= 0.97
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_experts_too_big_for_float_stay_in_the_gguf(moe_gguf, tmp_path, monkeypatch):
    """A file whose packed tensors' float32 copies are too big for the machine (forced: the
    RAM share set to 0) converts without its experts' float copies (a Qwen3-30B-A3B Q4: ~120
    GB of them): the stacked expert tensors stay in the GGUF (named in the marker, absent
    from the safetensors), the engine serves them packed without ever reading a float copy,
    and ``none`` dequantises them from the GGUF: the same tokens as a full conversion."""
    from safetensors import safe_open

    from engine.loading import gguf_convert, loader, packed_policy
    from engine.loading.loader import resolve_model

    path, cache, _ = moe_gguf
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens(cache_dir, **kw):
        llm = _llm(path, cache_dir, monkeypatch, cpu_probe="off", **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    expected = {q: tokens(cache, quantization=q) for q in ("auto", "none")}
    monkeypatch.setattr(packed_policy, "PACKED_ONLY_RAM_FRACTION", 0.0)
    lean = resolve_model(str(path), cache_dir=tmp_path / "lean", progress=False)
    kept = gguf_convert.in_gguf_names(lean.path)
    stacked = [n for n in kept if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacked) == 2 * 2  # both layers' gate_up and down
    with safe_open(str(lean.path / "model.safetensors"), framework="pt") as handle:
        assert not set(handle.keys()) & set(kept)
    read: list[str] = []
    real = loader.iter_dir_weights

    def recording(*a, **kw):
        for name, t in real(*a, **kw):
            read.append(name)
            yield name, t

    monkeypatch.setattr("engine.weight_prep.prepare.iter_dir_weights", recording)
    assert tokens(tmp_path / "lean") == expected["auto"]
    assert read and not set(read) & set(stacked)  # no float expert copy read
    assert tokens(tmp_path / "lean", quantization="none") == expected["none"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def trained_moe_gguf(request, tmp_path_factory):
    """The tiny model of ``request.param`` trained 600 steps (~20 s) on a frozen copy of the
    docs (tests/support/training_corpus.txt: docs/*.md as of commit 5538a7a; trained on the
    docs as they are, the weights and so the agreement moved with every docs edit), as a
    GGUF, with HF's forward over the file's weights and the tests' English text as token
    ids."""
    from transformers import AutoModelForCausalLM

    from engine.cpu.kernels import load
    from engine.loading.loader import load_tokenizer, resolve_model
    from engine.loading.tiny_gguf import tiny_moe_model
    from engine.loading.tiny_training import docs_tokens, train

    load()
    root = tmp_path_factory.mktemp(f"trained-{request.param}")
    path = root / f"tiny-{request.param}.gguf"
    write_moe_gguf(path, request.param)  # the random file first: its tokenizer
    tok = load_tokenizer(resolve_model(str(path), progress=False))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_moe_model(request.param).config,
                                             dtype=torch.float32)
    corpus = Path(__file__).resolve().parents[3] / "tests" / "support" / "training_corpus.txt"
    model = train(model, docs_tokens(tok, corpus.read_text()), steps=600)
    _, reference = write_moe_gguf(path, request.param, model)
    return path, root / "cache", reference


@pytest.mark.slow
def test_default_config_agrees_on_a_trained_model(trained_moe_gguf, monkeypatch):
    path, cache, reference = trained_moe_gguf
    llm = _llm(path, cache, monkeypatch, cpu_probe="off", batch_invariant=True)
    assert llm.engine.config.batch_invariant  # as served by default
    assert _agreement(llm, reference) >= 0.97


def test_stacked_names_need_every_part():
    from engine.models.moe_model import expert_param_name, stacked_names

    names = [expert_param_name(layer, e, proj) for layer in (0, 3) for e in range(4)
             for proj in ("gate_proj", "up_proj", "down_proj")]
    names.remove(expert_param_name(3, 0, "up_proj"))  # layer 3's up not packed: keep its float
    assert stacked_names(names) == {"model.layers.0.mlp.experts.gate_up_proj",
                                    "model.layers.0.mlp.experts.down_proj",
                                    "model.layers.3.mlp.experts.down_proj"}
