"""A GGUF with Gemma 3 270M's shapes and random weights, for side-by-side speed runs.

No Gemma GGUF can be downloaded here, and speed does not depend on what the weights say, so
this writes one with ``gguf``'s own writer, laid out as llama.cpp's ``convert_hf_to_gguf.py``
+ ``llama-quantize`` lay out a Q4_0 Gemma 3 file: architecture ``gemma3``; 18 layers, 640
wide, 4 query heads and 1 KV head of 256, MLP 2,048, every sixth layer global and the others a
512-token sliding window (llama.cpp's fixed 5:1 pattern), RoPE bases 1e6 / 1e4; 262,144 token
rows as the real vocabulary has (the logits head is most of a 270M model's arithmetic); RMSNorm
weights stored as ``1 + w``; projections Q4_0 (``--type`` picks another block type), the tied
token table Q8_0, norms F32.

The vocabulary is SmolLM2's padded to 262,144 rows (benchmarks/shaped_gguf.py; prompts go as
token ids). Weights are N(0, 0.02) (norm scales around 1), so activations stay finite; the text
it writes is noise, and the benchmarks ask for a fixed number of tokens.

    PYTHONPATH=. python benchmarks/gemma3_gguf.py [--type Q4_1] OUT.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.shaped_gguf import add_padded_vocab, write_tensors

SHAPE = dict(layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256, ffn=2048,
             vocab=262_144, window=512, context=32_768)


def _tensors(rng: np.random.Generator):
    """(GGUF name, float32 array) of every tensor, as llama.cpp names Gemma 3's."""
    s = SHAPE
    h, d = s["hidden"], s["head_dim"]
    yield "token_embd.weight", rng.normal(0, 0.02, (s["vocab"], h))
    yield "output_norm.weight", 1.0 + rng.normal(0, 0.1, h)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (s["heads"] * d, h)), ("attn_k", (s["kv_heads"] * d, h)),
                            ("attn_v", (s["kv_heads"] * d, h)),
                            ("attn_output", (h, s["heads"] * d)), ("ffn_gate", (s["ffn"], h)),
                            ("ffn_up", (s["ffn"], h)), ("ffn_down", (h, s["ffn"]))):
            yield p + name + ".weight", rng.normal(0, 0.02, shape)
        for name, n in (("attn_norm", h), ("post_attention_norm", h), ("ffn_norm", h),
                        ("post_ffw_norm", h), ("attn_q_norm", d), ("attn_k_norm", d)):
            yield p + name + ".weight", 1.0 + rng.normal(0, 0.1, n)


def write(path: Path, seed: int = 0, block_type: str = "Q4_0") -> Path:
    """Write the file (see the module docstring), its projections in ``block_type`` (a GGUF
    type ``gguf.quants`` can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); returns ``path``."""
    import gguf

    s = SHAPE
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_name("Gemma 3 270M shape, random weights (kvserve benchmark)")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(s["window"])
    w.add_rope_freq_base(1e6)
    add_padded_vocab(w, s["vocab"])
    rng = np.random.default_rng(seed)
    q4, q8 = gguf.GGMLQuantizationType[block_type], gguf.GGMLQuantizationType.Q8_0
    write_tensors(w, _tensors(rng), 2 + 13 * s["layers"],
                  lambda name: q8 if name == "token_embd.weight" else q4, "writing Gemma 3 GGUF")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
                    help="the projections' block type (the token table stays Q8_0)")
    args = ap.parse_args()
    print(write(args.out, args.seed, args.type))


if __name__ == "__main__":
    main()
