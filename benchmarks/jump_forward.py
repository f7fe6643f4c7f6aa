"""What jump-forward drafts buy under a JSON schema: the embedded model answering the
four-people schema of benchmarks/structured_vs_llamacpp.py (greedy, chat), with the grammar's
forced text drafted (engine.structured.jump_forward) and without, same engine, runs interleaved.

    python benchmarks/jump_forward.py                      # concurrency 1, 4 and 16
    python benchmarks/jump_forward.py --concurrency 1 --requests 4 --repeats 3

Prints output tokens per second of wall time (median of the repeats) per concurrency and
setting, its ratio to the run without drafts, engine steps per output token, the share of
drafted tokens verification kept, and whether every answer equals the one without drafts
(it must: the drafts are verified). "k=8 forced text only" drafts the forced text as the
tokenizer spells it, never from the sequence's own tokens (JumpForward.use_context off): the
engine before drafts learnt from the sequence's history. "full head": every row's logits over
the whole vocabulary, then masked (the engine before engine/runner/logit_columns.py); the others
compute a constrained row at its allowed tokens where they are few. Ratios are to "off, full
head", plain constrained decoding as it was. Jump-forward's batch-size switch is lifted here
(``max_seqs`` None) so that each concurrency shows its own ratio; the engine's default switch
(``jump_forward_max_seqs``) is chosen from these figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_backends import cpu_isa  # noqa: E402
from benchmarks.structured_vs_llamacpp import SCHEMA, _messages  # noqa: E402

# name: (tokens per draft, drafts from the sequence's own tokens first, logits head restricted
# to the allowed tokens where the runner can)
SETTINGS = {"off, full head": (0, False, False), "off": (0, False, True),
            "k=3": (3, True, True), "k=8 forced text only": (8, False, True),
            "k=8, full head": (8, True, False), "k=8": (8, True, True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per run (default: 2 x concurrency, at least 4)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from engine import LLM, SamplingParams
    from engine.structured.spec import StructuredSpec

    llm = LLM(max_num_seqs=max(args.concurrency), structured_outputs_config={
        "jump_forward_tokens": max(k for k, _, _ in SETTINGS.values()),
        "jump_forward_max_seqs": None})
    jump = llm.engine.jump_forward
    can_restrict = llm.engine.restrict_logits_head
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured=StructuredSpec.json_schema(SCHEMA))
    llm.chat([_messages(0)], params)  # warm-up: kernels, the grammar compiled and cached
    results: dict[tuple[int, str], dict] = {}
    total = len(args.concurrency) * args.repeats * len(SETTINGS)
    with tqdm(total=total, desc="runs", file=sys.stderr) as bar:
        for c in args.concurrency:
            n = args.requests or max(4, 2 * c)
            convs = [_messages(i) for i in range(1, n + 1)]
            for _ in range(args.repeats):
                for name, (k, context, restrict) in SETTINGS.items():
                    llm.engine.scheduler.jump_forward = jump if k else None
                    jump.max_tokens, jump.use_context = max(k, 1), context
                    llm.engine.restrict_logits_head = restrict and can_restrict
                    steps0, d0, a0 = llm.engine.counters["num_steps"], jump.drafted, jump.accepted
                    texts = []
                    t0 = time.perf_counter()
                    for i in range(0, n, c):  # c requests at a time, as c users would
                        texts += [o.outputs[0] for o in llm.chat(convs[i:i + c], params)]
                    wall = time.perf_counter() - t0
                    r = results.setdefault((c, name), {"tps": [], "texts": None})
                    toks = sum(len(o.token_ids) for o in texts)
                    r["tps"].append(toks / wall)
                    r["steps_per_token"] = (llm.engine.counters["num_steps"] - steps0) / toks
                    r["kept"] = ((jump.accepted - a0) / (jump.drafted - d0)
                                 if jump.drafted > d0 else 0.0)
                    r["texts"] = [o.text for o in texts]
                    bar.update()
    print(f"CPU: {cpu_isa()}; embedded model; {args.max_tokens} max tokens, greedy, median of "
          f"{args.repeats}")
    print(f"{'conc':>4} {'setting':<20} {'tok/s':>8} {'ratio':>6} {'steps/tok':>9} "
          f"{'kept':>5} {'same output':>11}")
    for c in args.concurrency:
        base = results[(c, "off, full head")]
        base_tps = statistics.median(base["tps"])
        for name in SETTINGS:
            r = results[(c, name)]
            tps = statistics.median(r["tps"])
            same = sum(a == b for a, b in zip(r["texts"], base["texts"], strict=True))
            print(f"{c:>4} {name:<20} {tps:8.1f} {tps / base_tps:6.3f} {r['steps_per_token']:9.3f} "
                  f"{r['kept']:5.2f} {same:>5}/{len(r['texts'])}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
