"""``--load-format dummy``: random weights of a config's shape, no checkpoint read."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config.engine import EngineConfig
from engine.loading.tiny import byte_tokenizer, tiny_config


def _config_only_dir(tmp_path, **overrides):
    path = tmp_path / "shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_config("llama", **overrides).to_dict()))
    return path


def test_dummy_weights_serve_a_config_only_directory(tmp_path):
    path = _config_only_dir(tmp_path)
    tok = tmp_path / "tok"
    byte_tokenizer().save_pretrained(tok)
    llm = LLM(str(path), load_format="dummy", tokenizer=str(tok), dtype="float32",
              device="cpu", kv_cache_memory="4MiB")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    params = dict(llm.engine.runner.model.named_parameters())
    assert params["norm.weight"].eq(1).all()
    w = params["embed_tokens.weight"]
    assert 0.01 < float(w.std()) < 0.03  # N(0, 0.02), not uninitialised memory
    # Same seed, same weights: a dummy model is reproducible.
    again = LLM(str(path), load_format="dummy", tokenizer=str(tok), dtype="float32",
                device="cpu", kv_cache_memory="4MiB")
    assert again.engine.runner.model.embed_tokens.weight.equal(w)


def test_without_dummy_a_config_only_directory_is_refused(tmp_path):
    path = _config_only_dir(tmp_path)
    byte_tokenizer().save_pretrained(path)
    with pytest.raises(ValueError, match="no weights"):
        LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")


def test_load_format_is_validated():
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")


def test_shipped_8b_shape_is_llama_3_8b():
    from pathlib import Path

    from transformers import AutoConfig

    from engine.models.arch import ModelArch

    path = Path(__file__).resolve().parents[3] / "configs" / "models" / "llama-3.1-8b"
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path, local_files_only=True))
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 32, 8, 128)
    params = arch.shape.non_embedding_params() + 2 * arch.vocab_size * arch.hidden_size
    assert 8.0e9 < params < 8.1e9  # Llama 3.1 8B: 8.03 B parameters


def test_out_of_memory_in_a_step_fails_its_requests_not_the_engine(tmp_path):
    import torch

    path = _config_only_dir(tmp_path)
    byte_tokenizer().save_pretrained(path)
    llm = LLM(str(path), load_format="dummy", dtype="float32", device="cpu",
              kv_cache_memory="4MiB")
    runner = llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(inp, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)("fake OOM")
        return real(inp, *args, **kwargs)

    runner.execute = flaky
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([[1, 2, 3], [4, 5]], params)
    assert {o.outputs[0].finish_reason for o in first} == {"abort"}
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0
    after = llm.generate([[1, 2, 3]], params)  # the engine still serves
    assert after[0].outputs[0].finish_reason == "length"
    assert len(after[0].outputs[0].token_ids) == 4
