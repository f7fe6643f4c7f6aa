"""Percentiles and run summaries: turns per-request measurements into the figures a bench prints.

All latencies are kept in seconds internally and reported in milliseconds. Percentiles use linear
interpolation between order statistics (numpy's default), so p50 <= p90 <= p99 <= max always.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for an empty sequence."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100]; got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency metric, in milliseconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        ms = [v * 1000.0 for v in values]
        if not ms:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90),
                   percentile(ms, 99), min(ms), max(ms))


@dataclass
class RequestRecord:
    """What one benchmark request produced. Times are seconds on one monotonic clock.

    ``output_tokens`` is the server's usage count when it sent one, else the count taken from the
    stream; ``stream_tokens`` is always the stream's own count, so the two can be compared.
    """

    ok: bool
    start: float
    end: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    stream_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None
    expected_prompt_tokens: int = 0
    max_tokens: int = 0
    text: str = ""
    turn: int | None = None  # the turn's index in its conversation (chat workloads)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class RunSummary:
    """The figures of one benchmark run (one point of a sweep)."""

    label: str
    params: dict[str, Any]
    duration_s: float
    completed: int
    failed: int
    errors: list[str]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    efficiency: dict[str, Any] | None = None
    per_turn: list[dict[str, Any]] | None = None

    def turn_ttft_p50(self) -> list[float]:
        """TTFT p50 (ms) of each turn index; empty for a run without turns."""
        return [t["ttft_ms"]["p50"] for t in self.per_turn or []]

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))


def summarize(records: Sequence[RequestRecord], duration_s: float, label: str,
              params: dict[str, Any]) -> RunSummary:
    """Aggregate per-request records; failed requests count only in ``failed`` and ``errors``."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.expected_prompt_tokens
                 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    errors = sorted({(r.error or "unknown error")[:200] for r in failed})
    return RunSummary(
        label=label, params=params, duration_s=duration_s, completed=len(ok), failed=len(failed),
        errors=errors, prompt_tokens=prompt, cached_tokens=cached, output_tokens=out,
        request_throughput=len(ok) / dur, output_throughput=out / dur,
        total_token_throughput=(prompt + out) / dur,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([x for r in ok for x in r.itl]),
        e2e_ms=Distribution.of_seconds([r.e2e for r in ok]),
        per_turn=per_turn(records))


def per_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]] | None:
    """Per turn index of the conversations (None when no record has more than turn 0): the
    successful requests, their TTFT, and the mean prompt and prefix-cached tokens the server
    reported (None where it reported none)."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    if not turns or turns == [0]:
        return None
    out = []
    for t in turns:
        ok = [r for r in records if r.ok and r.turn == t]
        prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        out.append({"turn": t, "completed": len(ok),
                    "failed": sum(1 for r in records if not r.ok and r.turn == t),
                    "ttft_ms": asdict(Distribution.of_seconds(
                        [r.ttft for r in ok if r.ttft is not None])),
                    "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
                    "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
                    "output_tokens_mean": (sum(r.output_tokens for r in ok) / len(ok)
                                           if ok else None)})
    return out


def format_summary(s: RunSummary) -> str:
    """A human table of one run, in the layout of vLLM's benchmark printout."""
    w = 50
    lines = [f" {s.label} ".center(w, "="),
             f"{'Successful requests:':<34}{s.completed:>16}",
             f"{'Failed requests:':<34}{s.failed:>16}",
             f"{'Benchmark duration (s):':<34}{s.duration_s:>16.2f}",
             f"{'Total input tokens:':<34}{s.prompt_tokens:>16}",
             f"{'  of which prefix-cache hits:':<34}{s.cached_tokens:>16}",
             f"{'Total generated tokens:':<34}{s.output_tokens:>16}",
             f"{'Request throughput (req/s):':<34}{s.request_throughput:>16.2f}",
             f"{'Output token throughput (tok/s):':<34}{s.output_throughput:>16.2f}",
             f"{'Total token throughput (tok/s):':<34}{s.total_token_throughput:>16.2f}"]
    for title, short, d in (("Time to First Token", "TTFT", s.ttft_ms),
                            ("Time per Output Token (excl. 1st)", "TPOT", s.tpot_ms),
                            ("Inter-token Latency", "ITL", s.itl_ms),
                            ("End-to-end Latency", "E2EL", s.e2e_ms)):
        lines.append(f" {title} ".center(w, "-"))
        for name in ("mean", "p50", "p90", "p99"):
            lines.append(f"{f'{name.capitalize()} {short} (ms):':<34}{getattr(d, name):>16.2f}")
    if s.efficiency:
        e = s.efficiency
        lines.append(" Efficiency (useful FLOPs / matmul peak) ".center(w, "-"))
        lines.append(f"{'Useful work (GFLOP):':<34}{e['useful_gflop']:>16.1f}")
        lines.append(f"{'Achieved (GFLOP/s):':<34}{e['achieved_gflops']:>16.1f}")
        lines.append(f"{'Matmul peak (GFLOP/s, ' + e['peak_dtype'] + '):':<34}"
                     f"{e['peak_gflops']:>16.1f}")
        lines.append(f"{'Efficiency:':<34}{e['efficiency'] * 100:>15.1f}%")
    if s.per_turn:
        lines.append(" Per turn (TTFT p50, mean tokens) ".center(w, "-"))
        lines.append(f"{'turn':>4}{'n':>5}{'TTFT p50 (ms)':>15}{'prompt':>9}{'cached':>9}"
                     f"{'out':>8}")
        for t in s.per_turn:
            nums = [f"{v:>9.0f}" if (v := t[k]) is not None else f"{'-':>9}"
                    for k in ("prompt_tokens_mean", "cached_tokens_mean")]
            out = "-" if t["output_tokens_mean"] is None else f"{t['output_tokens_mean']:.1f}"
            lines.append(f"{t['turn']:>4}{t['completed']:>5}{t['ttft_ms']['p50']:>15.1f}"
                         f"{''.join(nums)}{out:>8}")
    if s.errors:
        lines.append(" Errors ".center(w, "-"))
        lines.extend(f"  {err}" for err in s.errors[:5])
    lines.append("=" * w)
    return "\n".join(lines)


def _json_safe(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
