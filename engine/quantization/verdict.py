"""What the start-up probe measured and decided (``engine.quantization.probe`` measures;
``engine.quantization.probe_cache`` stores; ``engine.weight_prep.apply`` applies).

``ProbeResult``: one measurement, two candidates' timed runs and whether they separate
(``SEPARATION``, the slowest quarter of each side dropped as stalls). ``Verdict``: which row
counts run packed (``quant``, ``hybrid``, ``float``) and the measured ``Setting`` of each
``SETTINGS`` key, a ``KernelChoice`` field (``Verdict.choices``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.quantization.kernel_choice import AMX_FROM, Q4_AMX, Q4_AMX_FROM, Q8_TILES


@dataclass
class ProbeResult:
    """Seconds of one pass over all linears (and the logits head) on each path: the best of
    the timed runs (``float_runs`` / ``quant_runs``, all of them)."""

    float_s: float
    quant_s: float
    float_runs: tuple[float, ...] = ()
    quant_runs: tuple[float, ...] = ()
    undecided: bool = False  # two measurements disagreed: no verdict whatever the runs say

    @property
    def decision(self) -> str | None:
        """``"quant"`` or ``"float"`` when that side is clearly faster: its kept runs
        (:func:`_kept`: the slowest quarter dropped) all beat the other side's kept runs by
        more than :data:`SEPARATION` (a stall only adds time, so a side whose true time is
        within that margin of the other's, less the runs' own jitter, wins only if every
        kept run of the other side stalled); None
        when the two ranges overlap (no verdict: the caller's documented default holds). A
        result without runs (a cached figure) compares its two figures."""
        if self.undecided:
            return None
        if not (self.float_runs and self.quant_runs):
            return "quant" if self.quant_s < self.float_s else "float"
        f, q = _kept(self.float_runs), _kept(self.quant_runs)
        if max(q) * (1 + SEPARATION) < min(f):
            return "quant"
        if max(f) * (1 + SEPARATION) < min(q):
            return "float"
        return None

    @property
    def use_quantised(self) -> bool:
        """The second option (``quant_s``) is clearly faster (:attr:`decision`)."""
        return self.decision == "quant"

    @property
    def float_clearly_faster(self) -> bool:
        """The first option (``float_s``) is clearly faster (:attr:`decision`)."""
        return self.decision == "float"

    @property
    def confirmed(self) -> bool:
        """Each side's best run has a second run within 25% of it: the best is the machine's
        speed, not a lucky or an unlucky moment (another busy process stalls every run)."""
        return all(len(runs) >= 2 and sorted(runs)[1] <= 1.25 * min(runs)
                   for runs in (self.float_runs, self.quant_runs))

    def merged(self, other: ProbeResult) -> ProbeResult:
        """Both measurements' runs together (a result without runs counts as one run)."""
        f = (self.float_runs or (self.float_s,)) + (other.float_runs or (other.float_s,))
        q = (self.quant_runs or (self.quant_s,)) + (other.quant_runs or (other.quant_s,))
        return ProbeResult(min(f), min(q), f, q)


SEPARATION = 0.05  # the relative gap by which two candidates' ranges must separate


def _kept(runs: tuple[float, ...]) -> list[float]:
    """``runs`` sorted, the slowest quarter dropped (stalls by another process only ever add
    time), at least two kept."""
    ordered = sorted(runs)
    return ordered[:max(min(2, len(ordered)), len(ordered) - len(ordered) // 4)]


@dataclass
class Verdict:
    """Which path serves which row counts: ``mode`` is ``quant`` (every size), ``hybrid``
    (quantised up to ``float_above`` rows, float beyond) or ``float``; ``probes`` maps each
    probed row count to its measurement. ``pending``: the settings are the defaults for now,
    to be measured after start-up and cached under this key (``--cpu-probe background``)."""

    mode: str
    float_above: int | None
    probes: dict[int, ProbeResult]
    settings: dict[str, Setting] = field(default_factory=dict)
    pending: str | None = None

    def setting(self, key: str) -> str:
        """The measured value of ``key`` (a :data:`SETTINGS` key), else its first option."""
        s = self.settings.get(key)
        return s.value if s is not None else SETTINGS[key][1][0]

    @property
    def panel_dtype(self) -> str:
        return self.setting("panel_dtype")

    @property
    def q4_kernel(self) -> str:
        return self.setting("q4_kernel")

    @property
    def q8_kernel(self) -> str:
        return self.setting("q8_kernel")

    @property
    def q4_prefill(self) -> str:
        return self.setting("q4_prefill")

    @property
    def q4_batch(self) -> str:
        return self.setting("q4_batch")

    @property
    def q4_layout(self) -> str:
        return self.setting("q4_layout")

    @property
    def q4_tiles(self) -> str:
        return self.setting("q4_tiles")

    @property
    def q8_batch(self) -> str:
        return self.setting("q8_batch")

    @property
    def q8_layout(self) -> str:
        return self.setting("q8_layout")

    @property
    def q8_tiles(self) -> str:
        return self.setting("q8_tiles")

    @property
    def q8_amx_from(self) -> str:
        return self.setting("q8_amx_from")

    @property
    def q4_amx(self) -> str:
        return self.setting("q4_amx")

    @property
    def q4_amx_from(self) -> str:
        return self.setting("q4_amx_from")

    def choices(self) -> dict:
        """Its settings as ``KernelChoice`` fields (``QuantLinear.choose(**choices)``)."""
        out: dict = {key: self.setting(key) for key in SETTINGS}
        out["panel_dtype"] = getattr(torch, out["panel_dtype"])
        return out

    def describe(self) -> str:
        text = "; ".join(f"{rows} rows: quantised {r.quant_s * 1e3:.2f} ms, float "
                         f"{r.float_s * 1e3:.2f} ms" for rows, r in self.probes.items())
        return "; ".join(t for t in [text, *(s.describe() for s in self.settings.values())] if t)

    @property
    def confirmed(self) -> bool:
        extra = [s.probe for s in self.settings.values() if s.probe is not None]
        return all(r.confirmed for r in [*self.probes.values(), *extra])

    def to_dict(self) -> dict:
        return {"mode": self.mode, "float_above": self.float_above,
                "probes": {str(n): [r.float_s, r.quant_s] for n, r in self.probes.items()},
                "settings": {k: [s.value, *([s.probe.float_s, s.probe.quant_s] if s.probe else [])]
                             for k, s in self.settings.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        if d["mode"] not in ("quant", "hybrid", "float"):
            raise ValueError(f"unknown verdict mode {d['mode']!r}")
        probes = {int(n): ProbeResult(f, q) for n, (f, q) in d["probes"].items()}
        settings = {}
        for key, (value, *times) in d.get("settings", {}).items():
            if key not in SETTINGS or value not in SETTINGS[key][1]:
                raise ValueError(f"unknown setting {key}={value!r}")
            settings[key] = Setting(key, value, ProbeResult(*times) if times else None)
        return cls(d["mode"], d["float_above"], probes, settings)


# A measured choice of the quantised modules: key -> (what it is, its options, the first the
# default). The decode kernels' row limit (``QuantLinear.dense_rows``, 32) is deliberately not
# one: measured lower (16 on an AMX machine), a short prompt would take the dense path on its
# first run and the decode kernels after a prefix-cache hit, and the same request would then
# decode differently (two numerics: int8-rounded activations vs bf16 panels).
SETTINGS = {"panel_dtype": ("prefill panels", ("float32", "bfloat16")),
            "q4_kernel": ("4-bit decode kernel", ("base", "vnni")),
            "q8_kernel": ("8-bit decode kernel", ("base", "vnni")),
            "q4_prefill": ("4-bit prefill", ("panels", "int8")),
            "q4_batch": ("4-bit decode batches", ("kernel", "tiles")),
            "q4_layout": ("4-bit layout", ("rows", "blocked")),
            "q4_tiles": ("4-bit tiles", ("avx2", "vnni")),
            "q8_batch": ("8-bit decode batches", ("kernel", "lanes")),
            "q8_layout": ("8-bit layout", ("rows", "interleaved")),
            "q8_tiles": ("8-bit interleaved batches", Q8_TILES),
            "q8_amx_from": ("AMX tiles from rows", AMX_FROM),
            "q4_amx": ("4-bit AMX tiles", Q4_AMX),
            "q4_amx_from": ("4-bit AMX tiles from rows", Q4_AMX_FROM)}


@dataclass
class Setting:
    """The value of a :data:`SETTINGS` key: its second option where ``probe`` measured it faster
    (``probe.quant_s`` times the second option, ``probe.float_s`` the first)."""

    key: str
    value: str
    probe: ProbeResult | None = None

    @classmethod
    def measured(cls, key: str, probe: ProbeResult) -> Setting:
        return cls(key, SETTINGS[key][1][1 if probe.use_quantised else 0], probe)

    def describe(self) -> str:
        what, (first, second) = SETTINGS[self.key]
        if self.probe is None:
            return f"{what} {self.value}"
        return (f"{what} {self.value} ({first} {self.probe.float_s * 1e3:.2f} ms, {second} "
                f"{self.probe.quant_s * 1e3:.2f} ms)")
