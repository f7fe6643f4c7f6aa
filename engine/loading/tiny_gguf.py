"""Tiny random GGUF files for the tests and benchmarks, written the way llama.cpp lays them out
(``gguf``'s writer and quantiser): the byte-level vocabulary of the tiny Llama-family models
(``add_byte_tokenizer``) and Qwen3-MoE / Mixtral models (Gemma: ``tiny_gguf_gemma``).

``write_moe_gguf(path, model_type)`` returns ``(hf_model, reference)``: the random HF model the
file was written from, and the same HF model with every quantised tensor replaced by
``gguf.quants.dequantize(gguf.quants.quantize(W))``: HF's forward pass over exactly the
weights the file holds (llama.cpp's Q/K row permutation of llama-architecture files moves
whole rows, and quantisation blocks lie along rows, so it commutes with the round trip).

Types: attention Q8_0, experts' gate/up Q4_0 and down Q8_0, token table and output Q8_0,
router and norms F32 (as llama.cpp's quantiser keeps ``ffn_gate_inp``). Mixtral is written as
llama.cpp writes it: architecture ``llama`` with ``llama.expert_count``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (as in its byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def add_byte_tokenizer(w) -> None:
    """The tiny models' tokenizer (``engine.loading.tiny``'s byte-level BPE: three specials,
    256 bytes, three merges) and the ChatML template, into GGUF writer ``w``."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list(SPECIALS + byte_alphabet() + ["he", "ll", "hell"])
    w.add_token_types([3] * len(SPECIALS) + [1] * (256 + len(MERGES)))
    w.add_token_merges(MERGES)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: interleaved rotary halves per head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}


def tiny_moe_model(model_type: str, seed: int = 0):
    """A random HF model (every tensor ~ N(0, 1), as the dense GGUF tests do: peaked logits)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=len(SPECIALS) + 256 + len(MERGES), hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, num_experts_per_tok=2)
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=32, num_experts=8, moe_intermediate_size=64,
                                intermediate_size=96, norm_topk_prob=True, rope_theta=5000.0)
    else:
        config = MixtralConfig(**common, head_dim=16, num_local_experts=4, intermediate_size=64,
                               rope_theta=5000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def write_moe_gguf(path: Path, model_type: str, model=None):
    """Write the GGUF (module docstring) of ``model`` (default: ``tiny_moe_model``'s); returns
    ``(hf_model, reference)``."""
    import gguf

    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    model = tiny_moe_model(model_type) if model is None else model
    reference = copy.deepcopy(model)
    ref = dict(reference.named_parameters())
    cfg = model.config
    arch = "qwen3moe" if model_type == "qwen3_moe" else "llama"
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"Tiny {model_type}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if model_type == "qwen3_moe":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    add_byte_tokenizer(w)

    def add(name: str, t: np.ndarray, qtype=None, hf: str | None = None,
            rows: slice | None = None) -> None:
        """Write ``t``; quantised when ``qtype``, and then the reference's ``hf`` (its
        ``rows`` along dim 1 for a gate/up half) gets the round-tripped values."""
        if qtype is None:
            w.add_tensor(name, t)
            return
        blocks = gguf.quants.quantize(t, qtype)
        w.add_tensor(name, blocks, raw_dtype=qtype)
        if hf is not None:
            back = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(t.shape))
            with torch.no_grad():
                target = ref[hf].data if rows is None else ref[hf].data[:, rows]
                target.copy_(back)

    permute = arch == "llama"
    for name, tensor in model.state_dict().items():
        t = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t, q8, name)
        elif name == "model.norm.weight":
            add("output_norm.weight", t)
        elif name == "lm_head.weight":
            add("output.weight", t, q8, name)
        else:
            _, _, layer, *rest = name.split(".")
            blk = f"blk.{layer}"
            module = ".".join(rest[:-1]) if rest[-1] == "weight" else ".".join(rest)
            if module == "input_layernorm":
                add(f"{blk}.attn_norm.weight", t)
            elif module == "post_attention_layernorm":
                add(f"{blk}.ffn_norm.weight", t)
            elif module.startswith("self_attn."):
                proj = module.split(".")[1]
                if permute and proj == "q_proj":
                    t = llama_cpp_permute(t, cfg.num_attention_heads)
                elif permute and proj == "k_proj":
                    t = llama_cpp_permute(t, cfg.num_key_value_heads)
                quantised = q8 if t.ndim == 2 else None
                if quantised is not None and permute and proj in ("q_proj", "k_proj"):
                    add(f"{blk}.{_ATTN[proj]}.weight", t, q8)  # reference: unpermuted below
                    _round_trip(ref[name], q8)
                else:
                    add(f"{blk}.{_ATTN[proj]}.weight", t, quantised, name)
            elif module == "mlp.gate":
                add(f"{blk}.ffn_gate_inp.weight", t)
            elif module == "mlp.experts.gate_up_proj":
                inter = t.shape[1] // 2
                add(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :inter]), q4,
                    name, slice(0, inter))
                add(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(t[:, inter:]), q4,
                    name, slice(inter, 2 * inter))
            elif module == "mlp.experts.down_proj":
                add(f"{blk}.ffn_down_exps.weight", t, q8, name)
            else:
                raise AssertionError(f"unexpected tensor {name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, reference


def _round_trip(param: torch.nn.Parameter, qtype) -> None:
    import gguf

    t = param.detach().numpy().astype(np.float32)
    back = gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype).reshape(t.shape)
    with torch.no_grad():
        param.copy_(torch.from_numpy(back))
