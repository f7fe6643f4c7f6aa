"""Speculative decoding (n-gram) vs plain decoding: single-stream TPOT on input-grounded prompts.

One engine (the embedded SmolLM2-135M-Instruct unless ``--model``), so both ways share the same
weights and the same ``quantization=auto`` verdict; speculation is switched per run at the
scheduler (its proposer kept, ``scheduler.spec`` set or cleared). Prompts ask the model to
copy from its input (a code edit, an extraction, a quotation): what prompt lookup exploits.
Each round runs every prompt once each way, alternating; TPOT = (last token - first token) /
(tokens - 1) from the request's timestamps; the medians over rounds are compared. Greedy, so
both ways must give the same tokens (reported: near-tie flips are possible when the quantised
linears serve 1 row and the float ones k + 1 rows, see docs/models.md). Prints acceptance per draft
position from the engine's spec_decode counters.

The adaptive switch (``disable_by_batch_size``): ``--batch 1,2,4,8`` times B different prompts decoded at once (output tok/s of the whole
``generate``), speculation forced on vs off (noisier: acceptance varies with the prompts).

    PYTHONPATH=. python benchmarks/spec_decode.py [--tokens 128] [--rounds 3] [--k 3]
        [--batch 1,2,4,8] [--threads N] [--quantization auto|none]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from engine import LLM, SamplingParams
from engine.config.speculative import SpeculativeConfig

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
LETTER = ("Dear Ms. Alvarez,\nThank you for your order of three blue ceramic mugs and one "
          "walnut serving board. Your order number is 48213. The parcel left our warehouse in "
          "Porto on Monday and should reach your address at 12 Harbour Street, Bristol, "
          "within five working days. If anything arrives damaged, reply to this message with "
          "a photo and we will send a replacement free of charge.\nKind regards,\nNuno Costa, "
          "Customer Care")
PROMPTS = [
    "Copy this Python code exactly, but rename the function moving_average to rolling_mean."
    f"\n```python\n{CODE}```",
    f"Repeat the following letter word for word.\n\n{LETTER}",
    f"Here is some code:\n```python\n{CODE}```\nRewrite it with comments added, keeping every "
    "line of the code.",
]


def _chat(llm: LLM, msgs: list[str], tokens: int):
    convs = [[{"role": "user", "content": m}] for m in msgs]
    return llm.chat(convs, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))


def _tpot_ms(out) -> float:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return (m.last_token_time - m.first_token_time) / (n - 1) * 1e3


def _spec_counts(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--batch", default="", help="comma-separated batch sizes to also time")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec_cfg = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4,
                                 prompt_lookup_min=2, disable_by_batch_size=None)
    llm = LLM(args.model, kv_cache_memory="512MiB", num_threads=args.threads,
              quantization=args.quantization, speculative_config=spec_cfg)
    sched = llm.engine.scheduler
    runner = llm.engine.runner
    verdict = runner.quant_verdict
    print(f"model {llm.engine.model_name} | linears {runner.linear_backend} | quantised "
          f"{runner.quantized} (float above {getattr(verdict, 'float_above', None)} rows) | "
          f"threads {llm.config.resolved_num_threads()} | ngram k={args.k} n=2..4")

    def run(spec: bool, msgs: list[str], tokens: int):
        sched.spec = spec_cfg if spec else None
        return _chat(llm, msgs, tokens)

    # Warm-up both ways, and every prompt once: the measured runs all start from the same
    # prefix-cache state. (With quantization=auto a prompt's uncached tail runs through the
    # quantised or the float linears depending on its length, so a first, uncached run can
    # differ in near-ties from later ones: a property of the cache state, not of speculation.)
    run(True, [PROMPTS[0]], 8)
    run(False, PROMPTS, 2)
    tpot: dict[str, list[list[float]]] = {"plain": [], "ngram": []}
    same = True
    before = _spec_counts(llm)
    for _ in range(args.rounds):
        row = {"plain": [], "ngram": []}
        for prompt in PROMPTS:
            outs = {}
            for name in ("plain", "ngram"):
                outs[name] = run(name == "ngram", [prompt], args.tokens)[0]
                row[name].append(_tpot_ms(outs[name]))
            same &= outs["plain"].outputs[0].token_ids == outs["ngram"].outputs[0].token_ids
        for name in row:
            tpot[name].append(row[name])
    after = _spec_counts(llm)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    result: dict = {"isa": _isa(), "k": args.k, "tokens": args.tokens, "prompts": []}
    print(f"\nsingle stream, {args.tokens} greedy tokens, median of {args.rounds} rounds:")
    for i, prompt in enumerate(PROMPTS):
        p = statistics.median(r[i] for r in tpot["plain"])
        s = statistics.median(r[i] for r in tpot["ngram"])
        print(f"  prompt {i} ({prompt[:38]!r}...): TPOT plain {p:7.2f} ms  ngram {s:7.2f} ms"
              f"  speed-up {p / s:4.2f}x")
        result["prompts"].append({"tpot_ms_plain": p, "tpot_ms_ngram": s, "ratio": p / s})
    p_all = statistics.median(sum(r) / len(r) for r in tpot["plain"])
    s_all = statistics.median(sum(r) / len(r) for r in tpot["ngram"])
    drafts = delta["spec_decode_num_drafts"]
    per_pos = [delta[f"spec_decode_num_accepted_tokens_pos{j}"] / max(drafts, 1)
               for j in range(args.k)]
    rate = delta["spec_decode_num_accepted_tokens"] / max(delta["spec_decode_num_draft_tokens"], 1)
    print(f"  all prompts: TPOT plain {p_all:.2f} ms, ngram {s_all:.2f} ms, speed-up "
          f"{p_all / s_all:.2f}x; outputs identical: {same}")
    print(f"  drafts {drafts}, acceptance {rate:.2f}, accepted per position: "
          f"{', '.join(f'{x:.2f}' for x in per_pos)}")
    result.update(tpot_ms_plain=p_all, tpot_ms_ngram=s_all, ratio=p_all / s_all,
                  identical=same, acceptance=rate, acceptance_per_pos=per_pos)
    if args.batch:
        result["batch"] = {}
        print("\nbatch (different prompts at once), output tok/s, speculation forced on/off:")
        for b in (int(x) for x in args.batch.split(",")):
            msgs = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(b)]
            rates = {}
            for name in ("plain", "ngram"):
                start = time.perf_counter()
                run(name == "ngram", msgs, args.tokens // 2)
                rates[name] = b * (args.tokens // 2) / (time.perf_counter() - start)
            print(f"  B={b:3d}: plain {rates['plain']:7.1f}  ngram {rates['ngram']:7.1f}  "
                  f"ngram/plain {rates['ngram'] / rates['plain']:4.2f}")
            result["batch"][b] = rates
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    if "avx512f" in flags:
        return "avx512" + ("+bf16" if "avx512_bf16" in flags else "")
    return "avx2" if "avx2" in flags else "other"


if __name__ == "__main__":
    main()
