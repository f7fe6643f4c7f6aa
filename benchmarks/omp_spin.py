"""What OpenMP's idle spinning costs a server whose cores are shared: ``kvserve serve`` (the
embedded model) started with libgomp's own spinning and with kvserve's bound
(``GOMP_SPINCOUNT=3000``, engine/cpu/omp_spin.py), alternated, quiet and with ``--load N``
spinning processes beside it. Each start: seconds to ``/health``, the start-up's
activation-precision measurement (its log line), then ``--requests`` requests of the README's
question one at a time (``max_tokens`` 16, each with its own ``cache_salt``): the first, the
median and the slowest of the rest.

    python benchmarks/omp_spin.py [--load 2] [--rounds 2] [--requests 16]

Prints one line per start, then for each load the two settings' medians side by side and their
ratio. Wall-clock: say which load and ISA it ran under."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_time import QUESTION, _busy, _get, isa, serving  # noqa: E402

# libgomp's own count, set explicitly (kvserve's entry point leaves a set value alone)
SETTINGS = {"libgomp's 300000": "300000", "kvserve's 3000": "3000"}


def one_start(env: dict[str, str], log: Path, requests: int, limit_s: float) -> dict:
    with serving([sys.executable, "-m", "server.cli"], env, log, limit_s) as (base, _, t0):
        health = time.monotonic() - t0
        times = []
        for i in range(requests):
            t1 = time.monotonic()
            _get(base + "/v1/chat/completions", {**QUESTION, "cache_salt": f"spin-{i}"},
                 timeout=600)
            times.append(time.monotonic() - t1)
    m = re.search(r"activation precision measured in ([0-9.]+) s", log.read_text())
    return {"health_s": health, "measure_s": float(m.group(1)) if m else None,
            "first_s": times[0], "median_s": statistics.median(times[1:]),
            "max_s": max(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=int, default=2, help="busy processes in the busy runs")
    ap.add_argument("--rounds", type=int, default=2, help="starts per setting and load")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--limit", type=float, default=300.0, help="seconds allowed to /health")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvserve-omp-spin-"))
    root = str(Path(__file__).resolve().parents[1])
    results: dict[tuple[int, str], list[dict]] = {}
    for load in sorted({0, args.load}):
        for r in range(args.rounds):
            for name, spins in SETTINGS.items():
                env = {k: v for k, v in os.environ.items()
                       if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
                env.update(PYTHONPATH=root, GOMP_SPINCOUNT=spins)
                busy = _busy(load)
                try:
                    got = one_start(env, work / f"load{load}-{r}-{len(results)}.log",
                                    args.requests, args.limit)
                finally:
                    for p in busy:
                        p.kill()
                results.setdefault((load, name), []).append(got)
                print(f"load {load} {name:18s} /health {got['health_s']:5.1f} s, activation "
                      f"measurement {got['measure_s']} s, first request {got['first_s']:.2f} s, "
                      f"later median {got['median_s']:.3f} s, slowest {got['max_s']:.2f} s",
                      flush=True)
    print(f"\nISA: {isa()}, {os.cpu_count()} CPUs; logs in {work}")
    for load in sorted({0, args.load}):
        row = {name: results[(load, name)] for name in SETTINGS}
        med = {n: statistics.median(x["median_s"] for x in rs) for n, rs in row.items()}
        worst = {n: max(max(x["first_s"], x["max_s"]) for x in rs) for n, rs in row.items()}
        health = {n: max(x["health_s"] for x in rs) for n, rs in row.items()}
        a, b = SETTINGS
        print(f"load {load}: later-request median {med[a]:.3f} vs {med[b]:.3f} s "
              f"({med[a] / med[b]:.2f}x), slowest request {worst[a]:.2f} vs {worst[b]:.2f} s, "
              f"slowest /health {health[a]:.1f} vs {health[b]:.1f} s ({a} vs {b})")


if __name__ == "__main__":
    main()
