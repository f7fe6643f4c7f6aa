"""What constrained decoding costs the engine: 16 concurrent requests on the embedded model,
all unconstrained vs half of them under a JSON schema (and under a regex), same run; the
constrained runs as the engine chooses (its defaults: each constraint served by the grammar
library measured faster for it, and the bitmask filled during the forward pass or before it,
whichever it measures faster) and forced each way (the regex on xgrammar, the schema on
llguidance; the fill overlapped or not).

    python benchmarks/structured_cost.py                 # 16 requests x 64 tokens, 3 repeats
    python benchmarks/structured_cost.py --concurrency 16 --output-len 64 --repeats 3

Every request generates exactly ``--output-len`` tokens (the unconstrained ones with
ignore_eos; the constraints cannot end sooner: an array of at least 40 objects, a regex of 100
words), so each run decodes the same number of tokens. Prints decode throughput (output tokens
per second of wall time, median of the repeats, runs interleaved) and its ratio to the
all-unconstrained run, the CPU ISA, and the compile time of a typical tool schema, uncached and
cached.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


LONG_JSON = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 40,
                                                       "items": {"type": "object", "properties": {
                                                           "id": {"type": "integer"},
                                                           "ok": {"type": "boolean"}},
                                                           "required": ["id", "ok"]}}},
             "required": ["rows"]}
LONG_REGEX = r"([a-z]{1,8} ){100}"
# a typical tool call's schema: its compile time, uncached and cached, is printed
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["get_weather", "search"]},
                   "arguments": {"type": "object", "properties": {
                       "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                       "required": ["city", "unit", "days"]}},
    "required": ["name", "arguments"]}


def cpu_isa() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), "?")
    return f"{info.get('Model name', '?').strip()}, {isa}, {info.get('CPU(s)', '?').strip()} CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from engine import LLM, SamplingParams
    from engine.params.structured import StructuredSpec

    llm = LLM()
    n, out_len = args.concurrency, args.output_len
    prompts = [f"Request {i}: write a list of records about item {i}." for i in range(n)]
    free = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    json_p = free.clone(structured=StructuredSpec.json_schema(LONG_JSON))
    regex_p = free.clone(structured=StructuredSpec.text("regex", LONG_REGEX))
    half_json = [json_p if i % 2 else free for i in range(n)]
    half_regex = [regex_p if i % 2 else free for i in range(n)]
    # The same languages written differently (their own cache entries), compiled by one
    # library each: what the per-constraint choice (engine.structured.routing) is measured
    # against.
    forced = {"xgrammar": StructuredSpec.text("regex", LONG_REGEX.replace(" )", "[ ])")),
              "llguidance": StructuredSpec.json_schema({**LONG_JSON, "title": "forced"})}
    for lib, spec in forced.items():
        llm.engine.structured.force(spec, lib)
    router = llm.engine.structured.backend
    regex_xg = free.clone(structured=forced["xgrammar"])
    json_llg = free.clone(structured=forced["llguidance"])
    # (params, bitmasks filled during the forward pass? None: as measured, the default)
    runs = {"unconstrained": ([free] * n, True),
            "half json_schema": (half_json, None),
            "half regex": (half_regex, None),
            "half regex, xgrammar": ([regex_xg if i % 2 else free for i in range(n)], None),
            "half json, llguidance": ([json_llg if i % 2 else free for i in range(n)], None),
            "half json, overlap": (half_json, True),
            "half json, no overlap": (half_json, False),
            "half regex, overlap": (half_regex, True),
            "half regex, no overlap": (half_regex, False)}
    llm.generate(prompts[:2], [json_p, regex_p])  # warm-up: kernels, grammar compiles cached
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, (params, overlap) in runs.items():
            llm.engine.structured.overlap_fill = overlap
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[name].append(time.perf_counter() - t0)
            got = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if got != n * out_len:
                raise RuntimeError(f"{name}: {got} tokens, expected {n * out_len}")

    structured = llm.engine.structured
    tool = StructuredSpec.json_schema(TOOL_SCHEMA)
    t0 = time.perf_counter()
    structured.compile(tool)  # vetted (both libraries probed) and compiled, then cached
    uncached = time.perf_counter() - t0
    t0 = time.perf_counter()
    structured.compile(tool)
    cached = time.perf_counter() - t0

    print(f"CPU: {cpu_isa()}; embedded model; concurrency {n}, {out_len} output tokens each, "
          f"median of {args.repeats}")
    base = n * out_len / statistics.median(times["unconstrained"])
    print(f"constraints served per library: {dict(router.chosen)}")
    print(f"{'run':<24} {'tok/s':>8} {'ratio':>6}")
    for name, ts in times.items():
        tps = n * out_len / statistics.median(ts)
        print(f"{name:<24} {tps:8.1f} {tps / base:6.3f}")
    print(f"tool-call schema compile: {uncached * 1e3:.2f} ms uncached, {cached * 1e6:.1f} us "
          f"cached")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
