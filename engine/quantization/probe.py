"""The start-up probe behind ``quantization="auto"``: which row counts run on packed quantised
weights and which on the float modules they replace, and how the packed modules' dense
(prefill) path multiplies, all by timing this model's modules on this machine.

:func:`choose` times the dense path with float32 and bfloat16 panels (:func:`probe_panels`),
then every replaced linear, float against quantised, at each of ``PROBE_ROWS`` (:func:`probe`):
the quantised path keeps the smallest counts it does not clearly lose, contiguously from one row
(a :class:`Verdict`: ``quant``, ``hybrid`` or ``float``); ``engine.weight_prep.apply`` caches and
applies it. A verdict noise cannot flip (issue 65): runs interleaved (:func:`_alternate`), a
measurement deciding only when the two sides' kept runs separate by ``SEPARATION`` (the slowest
quarter dropped), else the documented default holds; scattered runs are measured again and such
a verdict is not cached. Whether float weights may be kept is a memory question decided before
timing (``float_memory_reason``). ``choose(timer=...)`` injects the timer (tests)."""

from __future__ import annotations

import contextlib
import contextvars
import time

import torch
from torch import nn

from engine.quantization.linear import (
    AMX_FROM,
    BATCH_TILE_ROWS,
    DENSE_ROWS,
    LANES_ROWS,
    Q4_AMX,
    Q4_AMX_FROM,
    Q8_TILES,
    QuantisedModules,
    amx_available,
    interleaved_available,
    vnni_available,
)
from engine.quantization.verdict import (  # noqa: F401 (SEPARATION: re-exported)
    SEPARATION,
    SETTINGS,
    ProbeResult,
    Setting,
    Verdict,
)

PROBE_ROWS = (1, 4, 16, 64, 256)
DECODE_ROWS = (1, 16)  # the decode kernels' probe: one pass at each
BATCH_ROWS = (BATCH_TILE_ROWS, 16)  # the 4-bit batch tiles' probe: one pass at each
LANES_BATCH_ROWS = (LANES_ROWS, 16)  # the 8-bit lanes kernel's probe: one pass at each
MAX_PROBE_ATTEMPTS = 2  # then an undecided measurement keeps the default


@torch.no_grad()
def choose(model: nn.Module, q: QuantisedModules, rows: tuple[int, ...] = PROBE_ROWS,
           force: bool = False, float_allowed: bool = True, timer=None) -> Verdict:
    """First the quantised modules' own settings (:func:`measure_settings`), then each row
    count in increasing order, float against quantised; the quantised path keeps the smallest
    counts where float is not clearly faster (:attr:`ProbeResult.decision`: overlapping
    ranges keep the packed weights; a float win must hold in a second, separate measurement
    too), contiguously from 1 row. A measurement whose runs
    disagree (:attr:`ProbeResult.confirmed`: the machine is busy) is taken again, up to
    ``MAX_PROBE_ATTEMPTS`` times. ``force``: measure, but use the quantised path for all.
    ``float_allowed`` False (the float copies would cost more memory than allowed): the row
    counts are not probed, the packed weights serve all. ``timer(run, side)``: runs the
    zero-argument pass ``run`` of ``side`` (0: float or a setting's first option, 1: quantised
    or its second) and returns its seconds (default: ``time.perf_counter`` around it)."""
    with _timer(timer):
        settings = measure_settings(q, rows)
        if not float_allowed:
            return Verdict("quant", None, {}, settings)
        return _choose_rows(model, q, rows, force, settings)


def _choose_rows(model: nn.Module, q: QuantisedModules, rows: tuple[int, ...], force: bool,
                 settings: dict) -> Verdict:
    probes: dict[int, ProbeResult] = {}
    wins_up_to = 0
    for n in sorted(rows):
        measure = lambda repeats, n=n: probe(model, q, rows=n, repeats=repeats)  # noqa: E731
        probes[n] = confirmed_probe(measure, 3 if n <= 16 else 2)
        if probes[n].float_clearly_faster:  # the costly verdict: a second, separate measurement
            again = measure(3)
            if not again.float_clearly_faster:
                probes[n] = ProbeResult(min(again.float_s, probes[n].float_s),
                                        min(again.quant_s, probes[n].quant_s),
                                        probes[n].float_runs + again.float_runs,
                                        probes[n].quant_runs + again.quant_runs, undecided=True)
        if wins_up_to == len(probes) - 1 and not probes[n].float_clearly_faster:
            wins_up_to = len(probes)
    ordered = sorted(probes)
    if force or wins_up_to == len(ordered):
        return Verdict("quant", None, probes, settings)
    if wins_up_to == 0:
        return Verdict("float", None, probes, settings)
    return Verdict("hybrid", ordered[wins_up_to - 1], probes, settings)


def measure_settings(q: QuantisedModules, rows: tuple[int, ...] = PROBE_ROWS,
                     on_setting=None) -> dict[str, Setting]:
    """Time and apply the quantised modules' settings: where the AVX-512 VNNI kernels are built
    and 4-bit weights exist, first the int8 tiles' instructions (:func:`probe_q4_tiles`: the
    same floats, only speed to choose by); then the dense path's panel dtype at the
    largest probed row count above ``DENSE_ROWS`` (:func:`probe_panels`; none probed: float32),
    then at that count, where 4-bit weights exist, those panels against the int8 tiled kernel
    (:func:`probe_q4_prefill`), and where the AVX-512 VNNI kernels are built, the 4-bit and
    the 8-bit decode kernels at 1 and 16 rows, each where such weights exist
    (:func:`probe_decode_kernels`), and then the 8-bit decode kernel against the lanes kernel
    on batches of ``LANES_BATCH_ROWS`` (:func:`probe_q8_batches`); where the interleaved 8-bit
    kernel is built (AVX2), all of that (the rows layout) against the interleaved layout at
    ``DECODE_ROWS`` (:func:`probe_q8_layout`); where the AMX tiles are available and weights
    are interleaved, their VNNI lanes against AMX tiles at ``AMX_FROM[0]`` rows
    (:func:`probe_q8_tiles`), and with AMX, the rows from which they serve
    (:func:`probe_q8_amx_from`); last, with 4-bit weights, their decode kernel
    against the int8 tiles on batches of ``BATCH_ROWS`` (:func:`probe_q4_batches`), then all
    of that (the rows layout) against the blocked layout at ``DECODE_ROWS``
    (:func:`probe_q4_layout`); and where the AMX tiles are available, the blocked 4-bit
    layers (what batch-invariant mode serves) on a prefill chunk, int8 tiles against AMX
    tiles (:func:`probe_q4_amx`), and with AMX, whether decode batches of 16 take them too
    (:func:`probe_q4_amx_from`). Each setting is applied as it is measured;
    ``on_setting(setting)`` is then called with it (progress)."""
    settings: dict[str, Setting] = {}

    def take(key: str, measure, repeats: int) -> str:
        settings[key] = Setting.measured(key, confirmed_probe(measure, repeats))
        apply_settings(q, Verdict("quant", None, {}, settings))
        if on_setting is not None:
            on_setting(settings[key])
        return settings[key].value

    dense = [n for n in rows if n > DENSE_ROWS]
    if vnni_available() and any(m.is_q4 for m in _layer_leaves(q)):
        tile_rows = (BATCH_ROWS[-1], max(dense, default=DENSE_ROWS))
        take("q4_tiles", lambda repeats: probe_q4_tiles(q, tile_rows, repeats), 3)
    if dense:
        panels = getattr(torch, take("panel_dtype",
                                     lambda repeats: probe_panels(q, max(dense), repeats), 2))
        if any(m.is_q4 for m in _layer_leaves(q)):
            take("q4_prefill",
                 lambda repeats: probe_q4_prefill(q, max(dense), panels, repeats), 2)
    for key, is_q4 in (("q4_kernel", True), ("q8_kernel", False)):
        if vnni_available() and any(m.is_q4 == is_q4 and not getattr(m, "is_q5", False)
                                    for m in leaf_modules(q)):
            take(key, lambda repeats, is_q4=is_q4: probe_decode_kernels(q, is_q4,
                                                                        repeats=repeats), 3)
    apply_settings(q, Verdict("quant", None, {}, settings))  # the 8-bit probes start from it
    if vnni_available() and _q8_leaves(q):  # against that kernel
        take("q8_batch", lambda repeats: probe_q8_batches(q, repeats=repeats), 3)
    if interleaved_available() and _q8_leaves(q):  # against all of that
        take("q8_layout", lambda repeats: probe_q8_layout(q, repeats=repeats), 3)
    if amx_available() and _interleaved_leaves(q):  # on that layout
        if take("q8_tiles", lambda repeats: probe_q8_tiles(q, repeats=repeats), 3) == "amx":
            take("q8_amx_from", lambda repeats: probe_q8_amx_from(q, repeats=repeats), 3)
    if any(m.is_q4 for m in leaf_modules(q)):  # against the decode kernel just chosen
        take("q4_batch", lambda repeats: probe_q4_batches(q, repeats=repeats), 3)
        take("q4_layout", lambda repeats: probe_q4_layout(q, repeats=repeats), 3)
    if amx_available() and any(m.is_q4 for m in _layer_leaves(q)):
        prefill = max(dense, default=2 * DENSE_ROWS)
        if take("q4_amx", lambda repeats: probe_q4_amx(q, prefill, repeats), 2) == "on":
            take("q4_amx_from", lambda repeats: probe_q4_amx_from(q, repeats=repeats), 3)
    return settings


def planned_settings(q: QuantisedModules, rows: tuple[int, ...] = PROBE_ROWS) -> int:
    """How many settings :func:`measure_settings` measures on ``q`` here at most (the AMX
    thresholds counted: they follow an AMX win): a progress display's denominator."""
    q4 = any(m.is_q4 for m in leaf_modules(q))
    q4_layers = any(m.is_q4 for m in _layer_leaves(q))
    q8 = bool(_q8_leaves(q))
    dense = any(n > DENSE_ROWS for n in rows)
    vnni, amx = vnni_available(), amx_available()
    decode = [any(m.is_q4 == is_q4 and not getattr(m, "is_q5", False) for m in leaf_modules(q))
              for is_q4 in (True, False)]
    return sum((vnni and q4_layers, dense, dense and q4_layers, vnni and decode[0],
                vnni and decode[1], vnni and q8, interleaved_available() and q8,
                2 * (amx and interleaved_available() and q8), 2 * q4, 2 * (amx and q4_layers)))


def apply_settings(q: QuantisedModules, verdict: Verdict) -> None:
    """Set every quantised module's panel dtype and decode kernels as ``verdict`` says."""
    choices = verdict.choices()
    for m in leaf_modules(q):
        m.choose(**choices)


def leaf_modules(q: QuantisedModules) -> list[nn.Module]:
    """Every ``QuantLinear`` of ``q`` (a ``QuantConcat``'s parts, the embedding's head)."""
    return [p for m in q.modules() for p in (m.parts if hasattr(m, "parts") else [m])]


def confirmed_probe(measure, repeats: int) -> ProbeResult:
    """``measure(repeats)``, merged with further measurements (3 repeats each) until its runs
    agree (:attr:`ProbeResult.confirmed`) and separate (:attr:`ProbeResult.decision`: a tie
    with agreeing runs is final too), or ``MAX_PROBE_ATTEMPTS`` measurements were taken."""
    result = measure(repeats)
    for _ in range(MAX_PROBE_ATTEMPTS - 1):
        if result.confirmed:
            break
        result = result.merged(measure(3))
    return result


def float_modules(model: nn.Module, q: QuantisedModules) -> list[tuple[nn.Module, nn.Module]]:
    pairs = [(model.get_submodule(path), mod) for path, mod in q.linears.items()]
    if q.embedding is not None and model.lm_head is None:
        dense_head = model.tied_head
        pairs.append((dense_head if dense_head is not None else _TiedHead(model), q.embedding.head))
    return pairs


class _TiedHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.weight = model.embed_tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _inputs(modules: list[nn.Module], rows: int) -> dict[int, torch.Tensor]:
    widths = {m.in_features if hasattr(m, "in_features") else m.weight.shape[1] for m in modules}
    return {k: torch.randn(rows, k) for k in widths}


def _perf_timer(run, side: int) -> float:
    """Seconds of ``run()`` by ``time.perf_counter`` (``side`` unused: see :func:`choose`)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


_TIMER = [_perf_timer]  # the timer of the current choose() (a test injects its own)
# Called before every timed pass: per thread and per greenlet (a context variable).
_CHECKPOINT: contextvars.ContextVar = contextvars.ContextVar("probe_checkpoint", default=None)


@contextlib.contextmanager
def _timer(timer):
    """Time every pass with ``timer`` within the block (None: the timer already in place,
    :func:`_perf_timer` unless a test injected its own)."""
    saved = _TIMER[0]
    _TIMER[0] = timer or saved
    try:
        yield
    finally:
        _TIMER[0] = saved


@contextlib.contextmanager
def checkpoints(fn):
    """Call ``fn()`` before every timed pass run within the block (this thread, this greenlet):
    where a probe measured beside serving (``engine.weight_prep.background``) hands the engine
    its turn back; ``fn`` returns with the modules as the probe left them."""
    token = _CHECKPOINT.set(fn)
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def _alternate(passes: tuple, repeats: int, prepare: tuple | None = None) -> ProbeResult:
    """Time the two zero-argument ``passes`` alternately, ``repeats`` times each after one
    warm-up each; ``float_s`` is the first's best run, ``quant_s`` the second's. ``prepare``:
    two zero-argument calls, each run (untimed) before every run of its pass."""

    def timed(side: int) -> float:
        checkpoint = _CHECKPOINT.get()
        if checkpoint is not None:
            checkpoint()
        if prepare is not None:
            prepare[side]()
        return _TIMER[0](passes[side], side)

    for side in (0, 1):
        timed(side)
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for side in (0, 1):
            runs[side].append(timed(side))
    return ProbeResult(min(runs[0]), min(runs[1]), tuple(runs[0]), tuple(runs[1]))


@torch.no_grad()
def probe(model: nn.Module, q: QuantisedModules, rows: int = 1, repeats: int = 5) -> ProbeResult:
    """Time a ``rows``-row pass over every replaced linear, float then quantised, alternated
    ``repeats`` times (best pass of each kept). Each pass touches every weight once, as a decode
    step does, so the weights come from memory, not cache."""
    pairs = float_modules(model, q)
    inputs = _inputs([m for pair in pairs for m in pair], rows)

    def side(i: int):
        return lambda: [pair[i](inputs[pair[1].in_features]) for pair in pairs]

    return _alternate((side(0), side(1)), repeats)


def _layer_modules(q: QuantisedModules) -> list[nn.Module]:
    return [m for path, m in q.linears.items() if path.startswith("layers.")]


def _layer_leaves(q: QuantisedModules) -> list[nn.Module]:
    """The layers' ``QuantLinear``s (a ``QuantConcat``'s parts; not the logits head)."""
    return [p for m in _layer_modules(q) for p in (m.parts if hasattr(m, "parts") else [m])]


@torch.no_grad()
def _toggle(mods: list[nn.Module], rows: tuple[int, ...], choice: str, first, second,
            repeats: int, call=None) -> ProbeResult:
    """Time a pass over ``mods`` at each of ``rows`` row counts with every module's
    ``KernelChoice`` field ``choice`` at ``first`` (``float_s``) and at ``second``
    (``quant_s``), alternated (the switches untimed: a layout switch copies the weights);
    ``first`` again at the end.
    ``call(module, x)`` runs one module (default: its forward)."""
    call = call or (lambda m, x: m(x))
    inputs = {n: _inputs(mods, n) for n in rows}

    def set_all(value) -> None:
        for m in mods:
            m.choose(**{choice: value})

    def run() -> None:
        for n in rows:
            for m in mods:
                call(m, inputs[n][m.in_features])

    try:
        return _alternate((run, run), repeats, (lambda: set_all(first), lambda: set_all(second)))
    finally:
        set_all(first)


def probe_panels(q: QuantisedModules, rows: int, repeats: int = 3) -> ProbeResult:
    """The layers' quantised projections on their dense (prefill) path with float32 panels
    (``float_s``) against bfloat16 panels (``quant_s``), ``rows`` rows (the logits head is left
    out: prefill runs it on a few rows only). The modules are left with float32 panels."""
    mods = _layer_modules(q)
    return _toggle(mods, (rows,), "panel_dtype", torch.float32, torch.bfloat16, repeats)


def probe_q4_prefill(q: QuantisedModules, rows: int, panel_dtype: torch.dtype,
                     repeats: int = 3) -> ProbeResult:
    """The layers' 4-bit projections on their dense (prefill) path, ``rows`` rows: dequantised
    panels of ``panel_dtype`` (``float_s``) against the int8 tiled kernel (``quant_s``). Left
    on panels, of ``panel_dtype``."""
    mods = [m for m in _layer_leaves(q) if m.is_q4]
    for m in mods:
        m.choose(panel_dtype=panel_dtype)
    return _toggle(mods, (rows,), "q4_prefill", "panels", "int8", repeats)


def probe_q4_batches(q: QuantisedModules, rows: tuple[int, ...] = BATCH_ROWS,
                     repeats: int = 3) -> ProbeResult:
    """The 4-bit modules (the logits head among them, if 4-bit) on decode batches of ``rows``
    (the smallest the tiles may serve, and a larger one): their decode kernel (``float_s``)
    against the int8 tiles (``quant_s``). Left on the kernel."""
    mods = [m for m in leaf_modules(q) if m.is_q4]
    return _toggle(mods, rows, "q4_batch", "kernel", "tiles", repeats)


def _q8_leaves(q: QuantisedModules) -> list[nn.Module]:
    """The 8-bit ``QuantLinear``s of ``q`` (the logits head among them, if 8-bit)."""
    return [m for m in leaf_modules(q) if not m.is_q4 and not getattr(m, "is_q5", False)]


def probe_q8_batches(q: QuantisedModules, rows: tuple[int, ...] = LANES_BATCH_ROWS,
                     repeats: int = 3) -> ProbeResult:
    """The 8-bit modules (the logits head among them, if 8-bit: at a batch of decodes it is
    the largest) on decode batches of ``rows`` (the smallest the lanes kernel serves, and a
    larger one): their decode kernel (``float_s``) against ``quant_gemm_q8_batch``
    (``quant_s``). Left on the kernel."""
    return _toggle(_q8_leaves(q), rows, "q8_batch", "kernel", "lanes", repeats)


def probe_q8_layout(q: QuantisedModules, rows: tuple[int, ...] = DECODE_ROWS,
                    repeats: int = 3) -> ProbeResult:
    """The 8-bit modules (the logits head among them, if 8-bit) at ``rows`` (a single stream
    and a batch of decodes) stored in the rows layout with their settings so far (``float_s``:
    the decode kernel, the lanes on batches where chosen) against the interleaved layout
    (``quant_s``: ``quant_gemm_q8_interleaved`` at both). Left in the rows layout."""
    return _toggle(_q8_leaves(q), rows, "q8_layout", "rows", "interleaved", repeats)


def _interleaved_leaves(q: QuantisedModules) -> list[nn.Module]:
    """The 8-bit ``QuantLinear``s of ``q`` stored interleaved."""
    return [m for m in _q8_leaves(q) if m.interleaved]


def probe_q8_tiles(q: QuantisedModules, rows: tuple[int, ...] = (int(AMX_FROM[0]),),
                   repeats: int = 3) -> ProbeResult:
    """The interleaved 8-bit modules (the logits head among them, if 8-bit) on a decode batch
    of ``rows``: the kernel's VNNI lanes (``float_s``) against its AMX tiles (``quant_s``),
    from ``AMX_FROM[0]`` rows. Both give the same floats, bit for bit. Left on VNNI."""
    mods = _interleaved_leaves(q)
    for m in mods:
        m.choose(q8_amx_from=AMX_FROM[0])
    return _toggle(mods, rows, "q8_tiles", *Q8_TILES, repeats)


def probe_q8_amx_from(q: QuantisedModules, rows: tuple[int, ...] = (int(AMX_FROM[1]),),
                      repeats: int = 3) -> ProbeResult:
    """With ``q8_tiles == "amx"``, the interleaved 8-bit modules on a batch of ``rows``
    (``AMX_FROM[1]``): AMX tiles from ``AMX_FROM[0]`` rows, so VNNI here (``float_s``),
    against AMX tiles from ``AMX_FROM[1]`` rows (``quant_s``). Left from ``AMX_FROM[0]``."""
    return _toggle(_interleaved_leaves(q), rows, "q8_amx_from", *AMX_FROM, repeats)


def probe_decode_kernels(q: QuantisedModules, is_q4: bool, rows: tuple[int, ...] = DECODE_ROWS,
                         repeats: int = 3) -> ProbeResult:
    """The 4-bit (``is_q4``) or 8-bit modules, the logits head among them (decode runs it every
    step), on the ``base`` decode kernel (``float_s``) against the ``vnni`` one (``quant_s``):
    one pass at each of ``rows`` (a single stream and a batch of decodes; at one row a
    memory-bound weight can tie, and the batch then decides). Left on ``base``."""
    mods = [m for m in leaf_modules(q) if m.is_q4 == is_q4 and not getattr(m, "is_q5", False)]
    return _toggle(mods, rows, "q4_kernel" if is_q4 else "q8_kernel", "base", "vnni",
                   repeats)


def probe_q4_tiles(q: QuantisedModules, rows: tuple[int, ...], repeats: int = 3) -> ProbeResult:
    """The layers' 4-bit projections on the int8 tiles (``QuantLinear.tiles``: in the rows
    layout ``quant_gemm_q4_tiled``, whatever their other settings) at each of ``rows`` (a
    decode batch and a prefill chunk): the AVX2 tiles (``float_s``) against the VNNI tiles
    (``quant_s``). Both give the same floats, bit for bit. Left on AVX2."""
    mods = [m for m in _layer_leaves(q) if m.is_q4]
    return _toggle(mods, rows, "q4_tiles", "avx2", "vnni", repeats,
                   call=lambda m, x: m.tiles(x))


def probe_q4_layout(q: QuantisedModules, rows: tuple[int, ...] = DECODE_ROWS,
                    repeats: int = 3) -> ProbeResult:
    """The 4-bit modules (the logits head among them, if 4-bit) at ``rows`` (a single stream
    and a batch of decodes) stored in the rows layout with their settings so far
    (``float_s``) against the blocked layout (``quant_s``). Left in the rows layout."""
    mods = [m for m in leaf_modules(q) if m.is_q4]
    return _toggle(mods, rows, "q4_layout", "rows", "blocked", repeats)


def _blocked_q4_toggle(q: QuantisedModules, rows: tuple[int, ...], choice: str,
                       options: tuple[str, str], repeats: int) -> ProbeResult:
    """The layers' 4-bit projections stored blocked (converted for the measurement, their
    layout restored after) on their int8 tiles (``QuantLinear.tiles``) at ``rows``:
    ``choice`` at ``options[0]`` (``float_s``) against ``options[1]`` (``quant_s``)."""
    mods = [m for m in _layer_leaves(q) if m.is_q4]
    layouts = [m.kernels.q4_layout for m in mods]
    try:
        for m in mods:
            m.choose(q4_layout="blocked")
        return _toggle(mods, rows, choice, *options, repeats, call=lambda m, x: m.tiles(x))
    finally:
        for m, layout in zip(mods, layouts):
            m.choose(q4_layout=layout)


def probe_q4_amx(q: QuantisedModules, rows: int, repeats: int = 3) -> ProbeResult:
    """The layers' blocked 4-bit projections on a prefill chunk of ``rows`` rows: the int8
    tiles of ``q4_tiles`` (``float_s``) against AMX tiles (``quant_s``), from
    ``Q4_AMX_FROM[0]`` rows. Both give the same floats, bit for bit. Left off."""
    for m in _layer_leaves(q):
        m.choose(q4_amx_from=Q4_AMX_FROM[0])
    return _blocked_q4_toggle(q, (rows,), "q4_amx", Q4_AMX, repeats)


def probe_q4_amx_from(q: QuantisedModules, rows: tuple[int, ...] = (int(Q4_AMX_FROM[1]),),
                      repeats: int = 3) -> ProbeResult:
    """With ``q4_amx == "on"``, the layers' blocked 4-bit projections on a decode batch of
    ``rows`` (``Q4_AMX_FROM[1]``): AMX tiles from ``Q4_AMX_FROM[0]`` rows, so the int8 tiles
    here (``float_s``), against AMX tiles from ``Q4_AMX_FROM[1]`` (``quant_s``). Left from
    ``Q4_AMX_FROM[0]``."""
    return _blocked_q4_toggle(q, rows, "q4_amx_from", Q4_AMX_FROM, repeats)
