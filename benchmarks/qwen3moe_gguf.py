"""A GGUF with Qwen3-30B-A3B's layer shape and random weights, for side-by-side speed runs of a
mixture-of-experts model on a CPU (the model many llama.cpp users run there).

No MoE GGUF can be downloaded here, and the whole 30B file (17 GB at Q4_0, 48 layers) would
take long to write and fill this machine's memory with two servers' copies, so this writes
``--layers`` (default 8) layers of the real shape with ``gguf``'s own writer, laid out as
llama.cpp's ``convert_hf_to_gguf.py`` + ``llama-quantize`` lay out a Q4_0 Qwen3-MoE file:
architecture ``qwen3moe``; 2,048 wide, 32 query heads and 4 KV heads of 128 with QK-norm,
128 experts of 768 features each, 8 routed per token (router ``ffn_gate_inp`` kept F32);
151,936 token rows, untied output; projections and experts Q4_0, the token table and output
Q8_0, norms F32. Per token of decode a layer reads 8 of its 128 experts: ~21 MB of its 340 MB.

The vocabulary is SmolLM2's padded to 151,936 rows (benchmarks/shaped_gguf.py; prompts go as
token ids). Weights are N(0, 0.02) (norm scales around 1), the router's N(0, 0.05) so that
tokens spread over the experts; the text it writes is noise, and the benchmarks ask for a
fixed number of tokens.

    PYTHONPATH=. python benchmarks/qwen3moe_gguf.py OUT.gguf [--layers 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.shaped_gguf import add_padded_vocab, write_tensors

SHAPE = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
             expert_ffn=768, vocab=151_936, context=40_960)
PER_LAYER = 14  # tensors a layer writes


def _normal(rng: np.random.Generator, shape: tuple, std: float) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _tensors(rng: np.random.Generator, layers: int):
    """(GGUF name, float32 array) of every tensor, as llama.cpp names Qwen3-MoE's."""
    s = SHAPE
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    yield "token_embd.weight", _normal(rng, (s["vocab"], h), 0.02)
    yield "output_norm.weight", 1.0 + _normal(rng, (h,), 0.1)
    yield "output.weight", _normal(rng, (s["vocab"], h), 0.02)
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (s["heads"] * d, h)), ("attn_k", (s["kv_heads"] * d, h)),
                            ("attn_v", (s["kv_heads"] * d, h)),
                            ("attn_output", (h, s["heads"] * d)),
                            ("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)),
                            ("ffn_down_exps", (e, h, f))):
            yield p + name + ".weight", _normal(rng, shape, 0.02)
        yield p + "ffn_gate_inp.weight", _normal(rng, (e, h), 0.05)
        for name, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", d),
                        ("attn_k_norm", d)):
            yield p + name + ".weight", 1.0 + _normal(rng, (n,), 0.1)


def write(path: Path, layers: int = 8, seed: int = 0) -> Path:
    """Write the file (see the module docstring); returns ``path``."""
    import gguf

    s = SHAPE
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    w.add_name(f"Qwen3-30B-A3B layer shape, {layers} layers, random weights (kvserve benchmark)")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_expert_feed_forward_length(s["expert_ffn"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    add_padded_vocab(w, s["vocab"])
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    f32 = gguf.GGMLQuantizationType.F32

    def qtype(name: str):
        if name in ("token_embd.weight", "output.weight"):
            return q8
        return f32 if name.endswith("ffn_gate_inp.weight") else q4

    write_tensors(w, _tensors(np.random.default_rng(seed), layers), 3 + PER_LAYER * layers,
                  qtype, "writing Qwen3-MoE GGUF")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write(args.out, args.layers, args.seed))


if __name__ == "__main__":
    main()
