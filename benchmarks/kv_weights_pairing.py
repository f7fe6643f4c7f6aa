"""4-bit weights and a narrow KV cache together: do the two errors stack? (issue 32, item 3)

On the embedded model (SmolLM2-135M-Instruct, whose GGUF holds Q4_1 weights), each pairing of

* weights: ``float`` (the GGUF dequantised to float32, ``quantization="none"``) or ``4-bit``
  (the Q4_1 tensors kept packed, ``quantization="auto"`` with the probe forced on, so the
  packed kernels' int8 activations are in the error too);
* KV cache: float32 (the reference), float16, bfloat16, int8, int4, fp8_e4m3 at scale 1.0 and
  fp8_e4m3 with ``calculate_kv_scales`` (per-head scales from the built-in calibration text),
  int4 with ``calculate_kv_scales`` (per-channel key smoothing from the same text);

is measured teacher-forced against float weights + a float32 cache: top-1 agreement and the
perplexity delta, on text the calibration never saw (tests/models/teacher_forced.py's TEXT,
the chat prompts of tests/models/test_smollm2.py, then ``--license-tokens`` tokens of CPython's
``LICENSE.txt``, the text of ``kvserve bench streaming``: about 1,000 tokens, where 200 alone
leave about 1% of noise in a perplexity delta), prefilled in chunks of 16 tokens so that every
chunk after the first attends over the cache as decode does.

The float reference is the GGUF's own Q4_1 weights dequantised (the package ships no float
checkpoint), so the "4-bit" column's weight error is what the packed path adds to them: the
int8 rounding of activations per group of 32 (llama.cpp's, too). The "stacked" column is the
sum of the two errors alone; a pairing whose delta is near it stacks, one far above compounds.

    PYTHONPATH=. python benchmarks/kv_weights_pairing.py [--json docs/perf/kv-weights.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tqdm import tqdm

from bench.streaming import DEFAULT_TEXT
from benchmarks.kv_quant import isa
from engine import LLM
from tests.models.teacher_forced import TEXT, forced, perplexity_of
from tests.models.test_smollm2 import PROMPTS

KV = [  # (label, kv_cache_dtype, calculate_kv_scales)
    ("float32", "float32", False),
    ("float16", "float16", False),
    ("bfloat16", "bfloat16", False),
    ("int8", "int8", False),
    ("int4", "int4", False),
    ("int4 calibrated", "int4", True),
    ("fp8_e4m3 scale 1", "fp8_e4m3", False),
    ("fp8_e4m3 calibrated", "fp8_e4m3", True),
]
WEIGHTS = {"float": "none", "4-bit": "auto"}


def measure(weights: str, kind: str, calibrate: bool, ids: list[int]) -> list[tuple[int, float]]:
    llm = LLM(None, dtype="float32", quantization=WEIGHTS[weights], kv_cache_memory="64MiB",
              max_model_len=1024, max_num_batched_tokens=16, kv_cache_dtype=kind,
              calculate_kv_scales=calibrate)
    if weights == "4-bit":
        assert llm.engine.runner.quantized, "the packed weights did not engage"
    return forced(llm, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--license-tokens", type=int, default=790)
    ap.add_argument("--kv", nargs="*", default=None,
                    help="KV labels to run (default all; float32, the reference, always)")
    args = ap.parse_args()
    kv = [k for k in KV if args.kv is None or k[0] == "float32" or k[0] in args.kv]
    os.environ["KVSERVE_QUANT_FORCE"] = "1"  # keep the 4-bit weights packed whatever the probe
    tok = LLM(None, dtype="float32", quantization="none", kv_cache_memory="16MiB",
              max_model_len=1024).tokenizer
    ids = tok.encode(TEXT)
    for prompt in PROMPTS:
        ids += tok.encode(" " + prompt)
    ids += tok.encode("\n\n" + DEFAULT_TEXT.read_text())[: args.license_tokens]
    t0 = time.time()
    runs = {}
    for weights in tqdm(WEIGHTS, desc="weights"):
        for label, kind, calibrate in tqdm(kv, desc="KV dtypes", leave=False):
            runs[(weights, label)] = measure(weights, kind, calibrate, ids)
    ref = runs[("float", "float32")]
    ref_top1 = [rank == 1 for rank, _ in ref]
    ref_ppl = perplexity_of(ref)
    results = {}
    for (weights, label), ranked in runs.items():
        agree = sum((rank == 1) == want for (rank, _), want in zip(ranked, ref_top1)) / len(ref)
        ppl = perplexity_of(ranked)
        results[f"{weights} / {label}"] = {"weights": weights, "kv": label, "perplexity": ppl,
                                           "perplexity_delta": ppl / ref_ppl - 1,
                                           "top1_agreement": agree}
    print(f"\n4-bit weights x KV cache dtypes, embedded model, {len(ref)} tokens "
          f"teacher-forced, {isa()} ({time.time() - t0:.0f} s)")
    print("| KV cache | float weights: agreement | delta | 4-bit weights: agreement | delta | "
          "stacked (sum of the two alone) |")
    print("|---|---:|---:|---:|---:|---:|")
    w_alone = results["4-bit / float32"]["perplexity_delta"]
    for label, *_ in kv:
        f, q = results[f"float / {label}"], results[f"4-bit / {label}"]
        print(f"| {label} | {f['top1_agreement']:.1%} | {f['perplexity_delta']:+.2%} "
              f"| {q['top1_agreement']:.1%} | {q['perplexity_delta']:+.2%} "
              f"| {w_alone + f['perplexity_delta']:+.2%} |")
    if args.json:
        meta = {"isa": isa(), "tokens": len(ref), "reference_perplexity": ref_ppl,
                "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
