"""Tiny Gemma 2 / Gemma 3 GGUF files written with ``gguf``'s own writer, the way llama.cpp's
``convert_hf_to_gguf.py`` writes Gemma models: llama.cpp tensor names, every RMSNorm weight
stored with 1 added, no Q/K row permutation, tied output omitted, a sentencepiece ("llama")
vocabulary with Gemma's special tokens and a Gemma chat template.

Head dim 256 with one KV head (as Gemma 3 270M), so that transformers' default
``query_pre_attn_scalar`` (256) and llama.cpp's ``1 / sqrt(head_dim)`` agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == "
    "'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LETTERS = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + LETTERS
# Values the writer puts in the metadata (a Gemma 2 soft-cap away from its default shows
# whether it is read).
SOFTCAPS = {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0}
WINDOW = 16

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def tiny_gemma_hf(model_type: str):
    """A random tiny HF Gemma (``gemma2`` or ``gemma3_text``) in float32: 64 wide, two query
    heads and one KV head of 256, window 16, Gemma 3 with 6 layers (the 5:1 pattern)."""
    from transformers import AutoModelForCausalLM

    from engine.loading.tiny import tiny_config

    extra = dict(SOFTCAPS) if model_type == "gemma2" else {
        "num_hidden_layers": 6, "layer_types": None,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}
    config = tiny_config(model_type, vocab_size=len(VOCAB), num_attention_heads=2,
                         head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW,
                         max_position_embeddings=256, bos_token_id=2, eos_token_id=1,
                         pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.1)
    return model


def write_gemma_gguf(model, path: Path, quantised: bool = True) -> None:
    """``model`` as a ``gemma2``/``gemma3`` GGUF (``quantised``: linears Q4_0, token table
    Q8_0, norms F32, as a llama.cpp Q4_0 file; else all F32)."""
    import gguf

    cfg = model.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"Tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * len(SPECIALS) + [0.0] * 256 + [-1.0] * len(LETTERS))
    w.add_token_types([3] * len(SPECIALS) + [6] * 256 + [1] * len(LETTERS))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(GEMMA_TEMPLATE)
    for name, tensor in model.state_dict().items():
        t = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if name == "model.embed_tokens.weight":
            gname, qtype = "token_embd.weight", q8
        elif name == "model.norm.weight":
            gname, qtype = "output_norm.weight", None
        elif name == "lm_head.weight":
            continue  # tied
        else:
            _, _, layer, *rest = name.split(".")
            gname = f"blk.{layer}.{_NAMES['.'.join(rest[:-1])]}.weight"
            qtype = q4 if t.ndim == 2 else None
        if quantised and qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
