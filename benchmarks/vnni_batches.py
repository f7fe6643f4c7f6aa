"""The AVX-512 VNNI batch kernels against what served before them, in one process, on the same
model. ``--compare vnni`` (the default): the 4-bit int8 tiles on VNNI (``q4_tiles``) and the
8-bit lanes kernel (``q8_batch``); ``--compare q8-layout``: the 8-bit weights interleaved
(``q8_layout``) against the rows layout with those two kernels; ``--compare amx``: the
interleaved 8-bit weights' batches on AMX int8 tiles from 8 rows (``q8_tiles``,
``q8_amx_from``) against their VNNI lanes; ``--compare q4-amx``: the blocked 4-bit weights'
prefill (and decode batches from 16 rows) on AMX int8 tiles (``q4_amx``, ``q4_amx_from``)
against their int8 tiles.

* ``q4_tiles``: ``avx2`` (maddubs) against ``vnni`` (dpbusd). The same floats bit for bit
  (engine/cpu/csrc/quant_q4_tile.h).
* ``q8_batch``: ``kernel`` (the 8-bit decode kernel) against ``lanes``
  (engine/cpu/csrc/quant_gemm_q8_batch.cpp: a batch's rows in a register's lanes) for decode
  batches from ``LANES_ROWS`` rows; not in batch-invariant mode. The same integer sums in
  another float order: logits may differ in the last bits, so greedy tokens are compared, not
  required equal.
* ``q8_layout``: ``rows`` (the decode kernel for one row; batches on the lanes, where not
  batch-invariant, else on the decode kernel) against ``interleaved``
  (engine/cpu/csrc/quant_gemm_q8_interleaved.cpp: 16 outputs in a register's lanes, every row
  count, the lanes' floats bit for bit, batch-invariant). Against the lanes the floats are equal;
  against the decode kernel greedy tokens are compared, not required equal. Without VNNI (an
  AVX2 CPU, or kernels built with ``KVSERVE_CPU_MARCH=x86-64-v3``) both sides run the AVX2
  tiles and no lanes: the decode kernel against the interleaved kernel's AVX2 path.
* ``q8_tiles``: ``vnni`` against ``amx`` (engine/cpu/csrc/quant_gemm_q8_amx.cpp; where the
  AMX tiles are built and granted: Sapphire Rapids and later). The same floats bit for bit, so
  greedy tokens must be equal. (The C++ decode stack's own 8-bit layer linears stay on VNNI.)
* ``q4_amx``: ``off`` against ``on`` from 16 rows, every 4-bit weight stored blocked
  (engine/cpu/csrc/quant_gemm_q4_amx.cpp; where the AMX tiles are built and granted). The same
  floats bit for bit, so greedy tokens must be equal. Batch-invariant engines run their prefill
  on these tiles; per-size engines keep the panels for it (only decode batches change).

First each kernel family alone: every 4-bit layer linear (``QuantLinear.tiles``) and every
8-bit module (the logits head among them) at 1, 16 and 256 / 1, 6 and 16 rows, the two
settings alternated. Then two engines, batch-invariant (as served by default: the tiles only)
and not, with every module set to the old or the new pair in turn, the C++ decode stack
rebuilt, ``--repeats`` rounds alternated: one stream (1 prompt, 128 generated) and a batch (16
prompts of 280 tokens, 64 generated each), prefix caching off, float16 KV; prefill and
decode-only steps timed apart.

    PYTHONPATH=. python benchmarks/vnni_batches.py [--model F.gguf] [--repeats 3]
        [--compare vnni|q8-layout|amx|q4-amx]

(the model defaults to the embedded SmolLM2 Q4_1 GGUF, its token table and head Q8_0;
benchmarks/gemma3_gguf.py writes the Gemma 3 270M-shaped Q4_0 file with a 262,144-row Q8_0
head). ``--compare vnni`` needs a CPU with AVX-512 VNNI, ``q8-layout`` AVX2, ``amx`` and
``q4-amx`` AMX-INT8.
Prints the ISA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.loading.embedded import embedded_gguf_path  # noqa: E402
from engine.models.cpu_decode_stack import build_decode_stack  # noqa: E402
from engine.quantization.linear import (  # noqa: E402
    LANES_ROWS,
    QuantLinear,
    amx_available,
    quant_kernels,
    vnni_available,
)
from engine.sampling.params import SamplingParams  # noqa: E402

COMPARISONS = {
    "vnni": {"before": {"q4_tiles": "avx2", "q8_batch": "kernel", "q8_layout": "rows"},
             "after": {"q4_tiles": "vnni", "q8_batch": "lanes", "q8_layout": "rows"}},
    "q8-layout": {"before": {"q4_tiles": "vnni", "q8_batch": "lanes", "q8_layout": "rows"},
                  "after": {"q4_tiles": "vnni", "q8_batch": "lanes", "q8_layout": "interleaved"}},
    "amx": {"before": {"q8_layout": "interleaved", "q8_tiles": "vnni"},
            "after": {"q8_layout": "interleaved", "q8_tiles": "amx", "q8_amx_from": "8"}},
    "q4-amx": {"before": {"q4_layout": "blocked", "q4_amx": "off"},
               "after": {"q4_layout": "blocked", "q4_amx": "on", "q4_amx_from": "16"}},
}
# q8-layout where VNNI is not built: no VNNI tiles, no lanes
AVX2_Q8_LAYOUT = {"before": {"q4_tiles": "avx2", "q8_batch": "kernel", "q8_layout": "rows"},
                  "after": {"q4_tiles": "avx2", "q8_batch": "kernel", "q8_layout": "interleaved"}}


def _leaves(model) -> list[QuantLinear]:
    seen, out = set(), []
    for m in model.modules():
        for p in (m.parts if hasattr(m, "parts") else [m]):
            if isinstance(p, QuantLinear) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _apply(mods: list[QuantLinear], model, settings: dict[str, str]) -> None:
    """Set ``mods`` to ``settings`` (one side of a comparison); with a ``model``, rebuild its
    C++ decode stack (which captures them)."""
    for m in mods:
        for key, value in settings.items():
            getattr(m, f"set_{key}")(value)
    if getattr(model, "decode_stack", None) is not None:
        model.decode_stack, why = build_decode_stack(model)
        if model.decode_stack is None:
            sys.exit(f"no C++ decode stack: {why}")


def _kernels(sides: dict, mods: list[QuantLinear], call, rows: int, repeats: int):
    """Median seconds of one pass ``call(m, x)`` over ``mods`` at ``rows`` rows per side of
    ``sides`` (a comparison), and whether the outputs were equal."""
    g = torch.Generator().manual_seed(rows)
    xs = {m.in_features: torch.randn(rows, m.in_features, generator=g) for m in mods}
    runs: dict[str, list[float]] = {s: [] for s in sides}
    outs: dict[str, list[torch.Tensor]] = {}
    for _ in range(repeats):
        for side, settings in sides.items():
            _apply(mods, None, settings)
            t0 = time.perf_counter()
            out = [call(m, xs[m.in_features]) for m in mods]
            runs[side].append(time.perf_counter() - t0)
            outs.setdefault(side, out)
    same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
    return {s: statistics.median(r) for s, r in runs.items()}, same


def _workload(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Seconds of prefill steps and of decode-only steps (and their count), and the tokens."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    times = {"prefill": 0.0, "decode": 0.0, "decode_steps": 0}
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        prefill = bool(eng.scheduler.waiting) or any(
            q.num_computed_tokens < len(q.token_ids) - 1 for q in eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        times["prefill" if prefill else "decode"] += time.perf_counter() - t0
        times["decode_steps"] += 0 if prefill else 1
        for o in outs:
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    return times, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=3, help="engine rounds per side")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="vnni",
                    help="which settings to compare (see the docstring)")
    args = ap.parse_args()
    sides = COMPARISONS[args.compare]
    if args.compare in ("amx", "q4-amx") and not amx_available():
        sys.exit("the AMX tiles are not available on this CPU: nothing to compare")
    if not vnni_available():
        if args.compare == "vnni":
            sys.exit("the AVX-512 VNNI kernels are not built on this CPU: nothing to compare")
        sides = AVX2_Q8_LAYOUT
    path = args.model or str(embedded_gguf_path())
    engines = {inv: LLM(path, kv_cache_memory="512MiB", kv_cache_dtype="float16",
                        enable_prefix_caching=False, batch_invariant=inv)
               for inv in (True, False)}
    llm = engines[False]
    model = llm.engine.runner.model
    mods = _leaves(model)
    q4 = [m for m in mods if m.is_q4]
    q8 = [m for m in mods if m.is_q8]
    built = "VNNI built" if vnni_available() else "no VNNI"
    print(f"ISA {quant_kernels().quant_gemm_isa()} ({built}), {torch.get_num_threads()} "
          f"threads; {len(q4)} 4-bit and {len(q8)} 8-bit modules "
          f"({', '.join(f'{m.out_features}x{m.in_features}' for m in q8[:3])}"
          f"{', ...' if len(q8) > 3 else ''}); the probe chose "
          f"q4_tiles {mods[0].q4_tiles}, q4_amx {q4[0].q4_amx if q4 else '-'}, "
          f"q8_batch {q8[0].q8_batch if q8 else '-'}, "
          f"q8_layout {q8[0].q8_layout if q8 else '-'}, "
          f"q8_tiles {q8[0].q8_tiles if q8 else '-'}; comparing {args.compare}: "
          + "; ".join(f"{side} {settings}" for side, settings in sides.items()))
    if q4 and args.compare in ("vnni", "q4-amx"):
        print("4-bit layer linears on the tiles, one pass (median), before vs after:")
        for rows in (1, 16, 256) + ((2048,) if args.compare == "q4-amx" else ()):
            t, same = _kernels(sides, q4, lambda m, x: m.tiles(x), rows,
                               15 if rows < 64 else 5)
            print(f"  {rows:4d} rows  {t['before'] * 1e3:8.3f} ms  {t['after'] * 1e3:8.3f} ms  "
                  f"{t['before'] / t['after']:.2f}x  outputs identical: {same}")
    if q8:
        print("8-bit modules at decode sizes, one pass (median), before vs after:")
        for rows in (1, LANES_ROWS, 8, 16):
            t, same = _kernels(sides, q8, lambda m, x: m(x), rows, 9)
            print(f"  {rows:4d} rows  {t['before'] * 1e3:8.3f} ms  {t['after'] * 1e3:8.3f} ms  "
                  f"{t['before'] / t['after']:.2f}x  outputs identical: {same}")
    rng = random.Random(0)
    vocab = llm.engine.tokenizer.vocab_size
    work = {"one stream": ([[rng.randrange(100, vocab - 100) for _ in range(128)]],
                           SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)),
            "16 streams": ([[rng.randrange(100, vocab - 100) for _ in range(280)]
                            for _ in range(16)],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))}
    keys = [(inv, w) for inv in engines for w in work]
    runs = {(k, s): [] for k in keys for s in sides}
    tokens: dict = {}
    for _ in tqdm(range(args.repeats), desc="engine rounds (both sides in turn)"):
        for inv, w in keys:
            prompts, params = work[w]
            eng_model = engines[inv].engine.runner.model
            for side, settings in sides.items():
                _apply(_leaves(eng_model), eng_model, settings)
                times, toks = _workload(engines[inv], prompts, params)
                runs[((inv, w), side)].append(times)
                tokens.setdefault(((inv, w), side), toks)
    print(f"engines, median of {args.repeats} rounds (before -> after):")
    for key in keys:
        med = {s: {k: statistics.median(r[k] for r in runs[(key, s)])
                   for k in ("prefill", "decode", "decode_steps")} for s in sides}
        a, b = med["before"], med["after"]
        before, after = tokens[(key, "before")], tokens[(key, "after")]
        same = sum(before[k] == after[k] for k in before)
        mode = "invariant" if key[0] else "per-size "
        print(f"  {mode} {key[1]:10s} prefill {a['prefill']:6.2f} -> {b['prefill']:6.2f} s "
              f"({a['prefill'] / b['prefill']:.2f}x)   decode step "
              f"{a['decode'] / a['decode_steps'] * 1e3:6.2f} -> "
              f"{b['decode'] / b['decode_steps'] * 1e3:6.2f} ms "
              f"({a['decode'] / b['decode']:.2f}x)   greedy tokens equal in "
              f"{same}/{len(before)} requests")


if __name__ == "__main__":
    main()
