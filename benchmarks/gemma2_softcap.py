"""Gemma 2's soft-capped attention: the compiled CPU decode kernel (and the C++ decode stack)
against the explicit softmax it replaced, side by side in one process, steps interleaved.

Side A is served as before the kernel capped scores: the torch backend's gathered keys and an
explicit ``tanh`` + softmax for every decode row (with batch-invariant serving, the default,
every prompt row too), the Python layer loop; side B as served now. Both engines load the same
random Gemma 2-shaped checkpoint (written once, ``--layers`` x ``--hidden``, four query heads
and one KV head of 256 as Gemma 2 2B's heads are wide, a 4,096-token window, soft-cap 50),
RTN int4 weights as ``--quantization int4`` serves them, float16 KV.

    python benchmarks/gemma2_softcap.py                       # 4 prompts x 280 tokens, 32 out
    python benchmarks/gemma2_softcap.py --prompts 16 --input-len 512

Prints the summed prefill and decode step times of each side, B's speed-up and whether the
greedy tokens of the two sides agree (the cap is computed in float32 either way; tanh's last
bits differ between ``torch.tanh`` and the kernel's, so a near tie may differ).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_ab import interleave, report  # noqa: E402

from engine.cache_dir import default_cache_dir  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.tiny import make_tiny_model_dir  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402


def _model(layers: int, hidden: int) -> Path:
    path = default_cache_dir() / "bench-models" / f"gemma2-softcap-{layers}x{hidden}"
    if not (path / "config.json").exists():
        make_tiny_model_dir(path, "gemma2", hidden_size=hidden, intermediate_size=6 * hidden,
                            num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=256, sliding_window=4096,
                            initializer_range=0.02, attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, vocab_size=256,
                            max_position_embeddings=8192)
    return path


def _explicit(engine) -> None:
    """Serve ``engine`` as before: no compiled decode kernel for soft-capped scores (the torch
    backend's explicit softmax), no decode stack (the Python layer loop)."""
    runner = engine.runner
    runner.backend._decode_kernel = lambda q, fmt: None
    runner.model.decode_stack = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=280)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1152)
    args = ap.parse_args()
    path = _model(args.layers, args.hidden)
    a, b = "explicit softmax, Python loop", "compiled kernel, decode stack"
    engines = {}
    for side in (a, b):
        engines[side] = LLM(str(path), dtype="float32", quantization="int4",
                            kv_cache_memory="1GiB", kv_cache_dtype="float16").engine
    _explicit(engines[a])
    assert engines[b].runner.model.decode_stack is not None, "no decode stack on side B"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.input_len)]
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    times, tokens = interleave(engines, prompts, params)
    report(a, b, times, tokens, f"Gemma 2 shape ({args.layers} layers x {args.hidden}), "
           f"{args.prompts} prompts x {args.input_len} tokens, {args.output_len} output tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
