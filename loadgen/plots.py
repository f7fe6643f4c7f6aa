"""PNG plots of bench results (matplotlib, Agg backend: no display needed).

``plot_results`` looks at what a result holds and draws what applies:
* throughput and TPOT vs concurrency  — runs that sweep ``concurrency`` (serve or offline);
* TTFT vs shared-prefix length        — runs that sweep ``prefix_len`` (one series per label,
                                        e.g. "prefix caching on" / "off");
* KV-cache speed-up over recompute vs generated length — offline points with a recompute run;
* offline output throughput per system.
Series are grouped by run label, so ``--compare`` adds earlier runs as extra lines.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_SWEPT = ("workload", "input_len", "output_len", "prefix_len", "concurrency", "request_rate")


def _series(runs: Iterable[dict[str, Any]], x_key: str) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped into lines, sorted by ``params[x_key]``. A line is one label and one value
    of every other parameter that varies across the runs (e.g. one line per prefix length in a
    concurrency plot)."""
    runs = list(runs)
    varying = [k for k in _SWEPT if k != x_key
               and len({repr(r["params"].get(k)) for r in runs}) > 1]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        name = " ".join([r.get("label") or "run"]
                        + [f"{k}={r['params'].get(k)}" for k in varying])
        groups[name].append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: _x(r, x_key))
    return dict(groups)


def _x(run: dict[str, Any], key: str) -> float:
    v = run["params"].get(key)
    if v is None and key == "concurrency":
        return float(run["params"].get("num_requests") or math.inf)  # all at once
    return float(v if v is not None else math.nan)


def _sweeps(runs: list[dict[str, Any]], key: str) -> bool:
    return any(len({_x(r, key) for r in rs}) >= 2 for rs in _series(runs, key).values())


def plot_concurrency(runs: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rs in _series(runs, "concurrency").items():
        xs = [_x(r, "concurrency") for r in rs]
        ax1.plot(xs, [r["output_throughput"] for r in rs], marker="o", label=label)
        (line,) = ax2.plot(xs, [r["tpot_ms"]["mean"] for r in rs], marker="o",
                           label=f"{label} (mean)")
        ax2.plot(xs, [r["tpot_ms"]["p99"] for r in rs], marker="x", ls="--",
                 color=line.get_color(), label=f"{label} (p99)")
    for ax, ylabel, title in ((ax1, "output tokens/s", "Output throughput"),
                              (ax2, "ms per output token", "TPOT (time per output token)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_prefix_ttft(runs: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, rs in _series(runs, "prefix_len").items():
        xs = [_x(r, "prefix_len") for r in rs]
        (line,) = ax.plot(xs, [r["ttft_ms"]["mean"] for r in rs], marker="o",
                          label=f"{label} (mean)")
        ax.plot(xs, [r["ttft_ms"]["p50"] for r in rs], marker="x", ls="--",
                color=line.get_color(), label=f"{label} (p50)")
    ax.set_xlabel("shared prefix length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT vs shared-prefix length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup(points: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    pts = sorted((p["output_len"], p["speedup_vs_recompute"]) for p in points
                 if p.get("speedup_vs_recompute"))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("generated tokens per request")
    ax.set_ylabel("speed-up (wall time, recompute / KV cache)")
    ax.set_title("KV cache speed-up over recomputing every step")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_offline_throughput(points: list[dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    systems = list(dict.fromkeys(r["system"] for p in points for r in p["systems"]
                                 if not r["note"]))  # kvserve first, then the baselines
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / max(len(systems), 1)
    for i, name in enumerate(systems):
        xs, ys = [], []
        for j, p in enumerate(points):
            row = next((r for r in p["systems"] if r["system"] == name and not r["note"]), None)
            if row is not None:
                xs.append(j + i * width)
                ys.append(row["output_throughput"])
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
    ax.set_xticklabels([f"{p['output_len']} out" for p in points])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline generation throughput")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(result: dict[str, Any], out_dir: str | Path,
                 extra_runs: Iterable[dict[str, Any]] = ()) -> list[Path]:
    """Write every plot that ``result`` (plus ``extra_runs``) has data for; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = list(result.get("runs", [])) + list(extra_runs)
    written = []
    if _sweeps(runs, "concurrency"):
        written.append(plot_concurrency(runs, out / "throughput_tpot_vs_concurrency.png"))
    prefix_runs = [r for r in runs + list(result.get("prefix_runs", []))
                   if r["params"].get("workload") == "shared-prefix"]
    if _sweeps(prefix_runs, "prefix_len"):
        written.append(plot_prefix_ttft(prefix_runs, out / "ttft_vs_prefix_len.png"))
    points = result.get("throughput", [])
    if sum(1 for p in points if p.get("speedup_vs_recompute")) >= 2:
        written.append(plot_speedup(points, out / "kv_cache_speedup_vs_length.png"))
    if points:
        written.append(plot_offline_throughput(points, out / "offline_throughput.png"))
    return written
