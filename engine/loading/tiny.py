"""Tiny randomly initialised Llama-family checkpoints for tests and benchmarks (no download).

Each gets a byte-level tokenizer (256 byte tokens + <s>, </s>) with a ChatML-like template, so
the engine can load the directory exactly as it would load a real HF checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 260  # 256 bytes + specials + spare
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(model_type: str = "llama", **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=256, eos_token_id=257,
                  tie_word_embeddings=False)
    common.update(overrides)
    if model_type == "llama":
        return LlamaConfig(**common)
    if model_type == "mistral":
        common.setdefault("sliding_window", 8)
        return MistralConfig(**common)
    if model_type == "qwen2":
        return Qwen2Config(**common)
    if model_type == "qwen3":
        common.setdefault("head_dim", 32)
        return Qwen3Config(**common)
    if model_type == "qwen3_moe":  # 8 experts, 2 per token, layer 1 dense (mlp_only_layers)
        common.setdefault("head_dim", 32)
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                   norm_topk_prob=True, mlp_only_layers=[1])
        return Qwen3MoeConfig(**{**moe, **common})
    if model_type == "mixtral":  # 4 experts, 2 per token, experts of intermediate_size
        moe = dict(num_local_experts=4, num_experts_per_tok=2)
        return MixtralConfig(**{**moe, **common})
    if model_type in ("gemma2", "gemma3_text"):
        # Tiny Gemmas: few wide KV heads, a window smaller than the test prompts; the
        # distinctive scalars are set apart from their defaults so that a missed one shows.
        common.update(num_key_value_heads=overrides.get("num_key_value_heads", 1),
                      initializer_range=overrides.get("initializer_range", 1.0),
                      tie_word_embeddings=overrides.get("tie_word_embeddings", True))
        common.setdefault("head_dim", 32)
        common.setdefault("sliding_window", 8)
        common.setdefault("query_pre_attn_scalar", 24)
        if model_type == "gemma2":
            common["num_hidden_layers"] = overrides.get("num_hidden_layers", 3)
            common.setdefault("attn_logit_softcapping", 5.0)
            common.setdefault("final_logit_softcapping", 3.0)
            return Gemma2Config(**common)
        common["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"] * 2)
        common.setdefault("rope_parameters", {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
        return Gemma3TextConfig(**common)
    raise ValueError(model_type)


def make_tiny_model_dir(path: Path, model_type: str = "llama", seed: int = 0,
                        **overrides) -> Path:
    """Write a tiny random checkpoint (config, safetensors, tokenizer) into ``path``."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type.startswith("gemma"):  # Gemma norms start at 0 (scale 1 + w): randomise
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
                elif name.endswith("embed_tokens.weight"):  # x sqrt(hidden): keep it small
                    p.normal_(0.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path
