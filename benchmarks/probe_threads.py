"""Why the background start-up probe runs on the engine's own thread (a greenlet) and not on a
thread of its own: the kernel settings' probe (``measure_settings``) timed on the main thread
and on a second ``threading`` thread, alternately, on the embedded model's packed modules.

    python benchmarks/probe_threads.py [--model F.gguf] [--rounds 2]

Prints, per setting, each side's two candidates' times (ms) and the verdict on each thread,
then the ratio of the passes' total time (second thread / main thread). libgomp starts an
OpenMP region from a thread it did not create more slowly (docs/decisions.md, "Engine on the
main thread"): a probe there times its passes with that overhead and compares them with it.
"""

from __future__ import annotations

import argparse
import os
import threading

from benchmarks.startup_time import isa
from engine.llm import LLM
from engine.quantization.linear import QuantConcat, QuantEmbedding, QuantisedModules, QuantLinear
from engine.quantization.probe import apply_settings, measure_settings
from engine.quantization.verdict import Verdict


def quantised_modules(model) -> QuantisedModules:
    """The packed modules as the start-up probe sees them (layers' linears, the token table)."""
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, (QuantLinear, QuantConcat)) and name.startswith("layers.")
               and "." not in name.split(".", 2)[2]}
    emb = model.embed_tokens if isinstance(model.embed_tokens, QuantEmbedding) else None
    return QuantisedModules(linears=linears, embedding=emb)


def on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with LLM(args.model, cpu_probe="off", batch_invariant=False) as llm:
        q = quantised_modules(llm.engine.runner.model)
        totals = {"main": 0.0, "thread": 0.0}
        for r in range(args.rounds):
            for side in ("main", "thread"):
                apply_settings(q, Verdict("quant", None, {}, {}))  # the same start each time
                settings = measure_settings(q) if side == "main" else on_thread(
                    lambda: measure_settings(q))
                spent = sum(s.probe.float_s + s.probe.quant_s for s in settings.values()
                            if s.probe is not None)
                totals[side] += spent
                print(f"round {r + 1}, {side:6s}: " + "; ".join(
                    f"{k} {s.value} ({s.probe.float_s * 1e3:.2f}/{s.probe.quant_s * 1e3:.2f})"
                    for k, s in settings.items() if s.probe is not None), flush=True)
    print(f"\nISA: {isa()}, {os.cpu_count()} CPUs, torch threads {llm.engine.config.resolved_num_threads()}")
    print(f"best passes summed: main thread {totals['main'] * 1e3:.1f} ms, second thread "
          f"{totals['thread'] * 1e3:.1f} ms: {totals['thread'] / totals['main']:.2f}x")


if __name__ == "__main__":
    main()
