"""The start-up choice between packed quantised and float linears (engine/quantization/probe.py
``choose``) and the per-call routing it sets up (``QuantLinear.keep_float_above``).

The choice must follow the measurements only: the quantised path keeps the row counts it won,
contiguously from one row, and larger inputs go to the float module it replaced, so no batch
size runs on a path measured slower."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization import probe as quant_probe
from engine.quantization.linear import QuantisedModules
from engine.quantization.probe import ProbeResult, Verdict, choose
from engine.weight_prep import apply as quant_apply

gguf = pytest.importorskip("gguf")


# The real setting probes (the autouse fixture below replaces them in the module).
REAL_PANELS, REAL_KERNELS = quant_probe.probe_panels, quant_probe.probe_decode_kernels
REAL_Q4_PREFILL, REAL_Q4_BATCHES = quant_probe.probe_q4_prefill, quant_probe.probe_q4_batches
REAL_Q4_LAYOUT, REAL_Q4_TILES = quant_probe.probe_q4_layout, quant_probe.probe_q4_tiles
REAL_Q8_BATCHES, REAL_Q8_LAYOUT = quant_probe.probe_q8_batches, quant_probe.probe_q8_layout
REAL_Q8_TILES, REAL_Q8_AMX_FROM = quant_probe.probe_q8_tiles, quant_probe.probe_q8_amx_from
REAL_Q4_AMX, REAL_Q4_AMX_FROM = quant_probe.probe_q4_amx, quant_probe.probe_q4_amx_from


@pytest.fixture(autouse=True)
def _settings_measure_the_first_option_faster(monkeypatch):
    """The settings' probes, deterministic unless a test replaces them: float32 panels and
    the base decode kernels and the panels for 4-bit prefill win."""
    slower = lambda q, *args, **kw: ProbeResult(1.0, 2.0, (1.0, 1.0), (2.0, 2.0))  # noqa: E731
    monkeypatch.setattr(quant_probe, "probe_panels", slower)
    monkeypatch.setattr(quant_probe, "probe_decode_kernels", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_prefill", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_batches", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_layout", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_tiles", slower)
    monkeypatch.setattr(quant_probe, "probe_q8_batches", slower)
    monkeypatch.setattr(quant_probe, "probe_q8_layout", slower)
    monkeypatch.setattr(quant_probe, "probe_q8_tiles", slower)
    monkeypatch.setattr(quant_probe, "probe_q8_amx_from", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_amx", slower)
    monkeypatch.setattr(quant_probe, "probe_q4_amx_from", slower)
    monkeypatch.setattr(quant_probe, "amx_available", lambda: False)  # a test sets it


class _Recorder(nn.Module):
    """A stand-in quantised module of one width: records every value each setting is set to."""

    def __init__(self, is_q4: bool) -> None:
        super().__init__()
        self.is_q4 = is_q4
        self.set_to: dict[str, list] = {k: [] for k in quant_probe.SETTINGS}

    def choose(self, **changes) -> None:  # choose(<setting>=value): recorded
        for key, value in changes.items():
            self.set_to[key].append(value)


def _fake_probe(wins: dict[int, bool]):
    def probe(model, q, rows=1, repeats=5):
        return ProbeResult(float_s=1.0, quant_s=0.5 if wins[rows] else 2.0)
    return probe


@pytest.mark.parametrize(("wins", "mode", "above"), [
    ({1: True, 4: True, 16: True, 64: True, 256: True}, "quant", None),
    ({1: True, 4: True, 16: False, 64: False, 256: False}, "hybrid", 4),
    ({1: True, 4: False, 16: True, 64: True, 256: True}, "hybrid", 1),  # contiguous from 1 row
    ({1: False, 4: True, 16: True, 64: True, 256: True}, "float", None),
])
def test_choice_follows_the_measurements(monkeypatch, wins, mode, above):
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(wins))
    verdict = choose(nn.Module(), QuantisedModules())
    assert (verdict.mode, verdict.float_above) == (mode, above)
    assert sorted(verdict.probes) == [1, 4, 16, 64, 256]
    assert verdict.describe().startswith("1 rows: quantised " + ("500.00" if wins[1] else "2000.00"))


def test_force_uses_the_quantised_path_for_every_size(monkeypatch):
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 16, 64, 256),
                                                                        False)))
    assert choose(nn.Module(), QuantisedModules(), force=True).mode == "quant"


def test_inputs_above_the_crossover_go_to_the_float_module():
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from engine.quantization.gguf_blocks import from_gguf_blocks
    from engine.quantization.linear import QuantLinear, quant_kernels

    if quant_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    raw = quants.quantize(w, T.Q4_0)
    dense = torch.from_numpy(quants.dequantize(raw, T.Q4_0))
    q = QuantLinear(from_gguf_blocks(raw, int(T.Q4_0), (96, 64)))
    calls = []

    class Float(nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            return F.linear(x, dense)

    q.keep_float_above(4, Float())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    q(x[:4])  # 4 rows: the quantised kernel
    assert calls == []
    torch.testing.assert_close(q(x), F.linear(x, dense))  # 9 rows: the float module, exactly
    assert calls == [9]
    assert q.nbytes < dense.numel() * 4 / 4  # the fallback is not counted as packed bytes


def test_disagreeing_runs_are_measured_again(monkeypatch):
    """A busy machine stalls some runs: a row count whose runs disagree is probed again and
    the best of all runs decides."""
    calls = []

    def probe(model, q, rows=1, repeats=5):
        calls.append(rows)
        if rows == 1 and calls.count(1) == 1:  # the first 1-row probe: quantised run stalled
            return ProbeResult(1.0, 9.0, (1.0, 1.1), (9.0, 30.0))
        return ProbeResult(1.0, 0.5, (1.0, 1.0), (0.5, 0.5))

    monkeypatch.setattr(quant_probe, "probe", probe)
    verdict = choose(nn.Module(), QuantisedModules())
    assert calls.count(1) == 2 and calls.count(4) == 1
    assert verdict.probes[1].quant_s == 0.5 and verdict.mode == "quant" and verdict.confirmed


def test_verdict_is_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_QUANT_REPROBE", raising=False)
    calls = []

    def probe(model, q, rows=1, repeats=5):
        calls.append(rows)
        return ProbeResult(1.0, 0.5 if rows <= 4 else 2.0, (1.0, 1.0), (0.5, 0.5) if rows <= 4
                           else (2.0, 2.0))

    monkeypatch.setattr(quant_probe, "probe", probe)
    first, how = quant_apply._cached_or_probed(nn.Module(), QuantisedModules(), force=False)
    assert (first.mode, first.float_above) == ("hybrid", 4) and "cached for later" in how
    n = len(calls)
    again, how = quant_apply._cached_or_probed(nn.Module(), QuantisedModules(), force=False)
    assert len(calls) == n and "cached" in how  # no probe: the stored verdict
    assert (again.mode, again.float_above) == ("hybrid", 4)
    assert again.probes[1].quant_s == 0.5
    monkeypatch.setenv("KVSERVE_QUANT_REPROBE", "1")
    quant_apply._cached_or_probed(nn.Module(), QuantisedModules(), force=False)
    assert len(calls) > n


def test_a_busy_machines_verdict_keeps_the_defaults_and_is_not_cached(monkeypatch, tmp_path):
    """Runs that never agree end after MAX_PROBE_ATTEMPTS; their ranges overlap, so no
    measurement decides: the packed weights serve (issue 65: noise must not inflate a packed
    file to float), and the verdict is not cached, so the next start measures again."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_QUANT_REPROBE", raising=False)
    calls = []

    def probe(model, q, rows=1, repeats=5):  # no two runs agree; quantised's best is a fluke
        calls.append(rows)
        if calls.count(rows) % 2:
            return ProbeResult(2.0, 0.5, (2.0, 3.0, 4.0), (0.5, 5.0, 6.0))
        return ProbeResult(2.6, 0.9, (2.6, 3.0, 4.0), (0.9, 5.5, 6.0))

    monkeypatch.setattr(quant_probe, "probe", probe)
    verdict, how = quant_apply._cached_or_probed(nn.Module(), QuantisedModules(), force=False)
    assert not verdict.confirmed and "not cached" in how and verdict.mode == "quant"
    assert calls.count(1) == quant_probe.MAX_PROBE_ATTEMPTS
    assert not list(tmp_path.rglob("*.json"))
    n = len(calls)
    quant_apply._cached_or_probed(nn.Module(), QuantisedModules(), force=False)
    assert len(calls) > n  # measured again


def test_cpu_probe_off_measures_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant_probe, "probe", lambda *a, **k: pytest.fail("probed"))
    verdict = quant_apply.adopt_if_faster(nn.Module(), QuantisedModules(), cpu_probe="off")
    assert verdict.mode == "quant" and verdict.settings == {}
    assert verdict.panel_dtype == "float32" and verdict.q4_layout == "rows"  # the defaults


@pytest.mark.parametrize(("bf16_s", "want"), [(0.4, "bfloat16"), (2.5, "float32")])
def test_panel_dtype_follows_its_measurement(monkeypatch, bf16_s, want):
    """The dense (prefill) path's panel dtype is the one measured faster at the largest probed
    row count above the kernels' limit; it is set on every module and kept in the verdict."""
    seen = []

    def probe_panels(q, rows, repeats=3):
        seen.append(rows)
        return ProbeResult(1.0, bf16_s, (1.0, 1.0), (bf16_s, bf16_s))

    monkeypatch.setattr(quant_probe, "probe_panels", probe_panels)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 16, 64, 256), True)))
    verdict = choose(nn.Module(), QuantisedModules())
    assert seen == [256] and verdict.panel_dtype == want
    assert f"prefill panels {want}" in verdict.describe()
    back = Verdict.from_dict(verdict.to_dict())
    assert (back.panel_dtype, back.mode) == (want, "quant")
    # Only decode-sized row counts probed: no dense path to choose for.
    seen.clear()
    assert choose(nn.Module(), QuantisedModules(), rows=(1, 4)).panel_dtype == "float32"
    assert seen == []


def test_a_cached_verdict_with_an_unknown_setting_is_refused():
    good = {"mode": "hybrid", "float_above": 16, "probes": {"1": [2.0, 1.0]},
            "settings": {"panel_dtype": ["bfloat16", 1.0, 0.5], "q4_kernel": ["vnni"]}}
    v = Verdict.from_dict(good)
    assert (v.mode, v.float_above, v.panel_dtype, v.q4_kernel) == ("hybrid", 16, "bfloat16", "vnni")
    assert Verdict.from_dict({**good, "settings": {}}).q4_kernel == "base"  # defaults
    with pytest.raises(ValueError, match="unknown setting"):
        Verdict.from_dict({**good, "settings": {"panel_dtype": ["float16"]}})


@pytest.mark.parametrize("is_q4", [True, False], ids=["4-bit", "8-bit"])
def test_decode_kernel_follows_its_measurement(monkeypatch, is_q4):
    """Where the AVX-512 VNNI kernels are built, each width's decode kernel is the one measured
    faster (1 and 16 rows), set on every module of that width (a QuantConcat's parts too); a width
    without modules is not probed and keeps ``base``."""
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: True)
    probed = []

    def vnni_faster(q, width_is_q4, rows=(1, 16), repeats=3):
        probed.append(width_is_q4)
        return ProbeResult(1.0, 0.7, (1.0, 1.0), (0.7, 0.7))

    monkeypatch.setattr(quant_probe, "probe_decode_kernels", vnni_faster)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 16, 64, 256), True)))
    fake = _Recorder(is_q4)
    verdict = choose(nn.Module(), QuantisedModules(linears={"layers.0.qkv_proj": fake}))
    mine, other = ("q4", "q8") if is_q4 else ("q8", "q4")
    assert probed == [is_q4]
    assert getattr(verdict, f"{mine}_kernel") == "vnni" and fake.set_to[f"{mine}_kernel"][-1] == "vnni"
    assert getattr(verdict, f"{other}_kernel") == "base"
    width = "4-bit" if is_q4 else "8-bit"
    assert f"{width} decode kernel vnni (base 1000.00 ms, vnni 700.00 ms)" in verdict.describe()
    assert getattr(Verdict.from_dict(verdict.to_dict()), f"{mine}_kernel") == "vnni"


@pytest.mark.parametrize(("int8_s", "want"), [(0.6, "int8"), (1.5, "panels")])
def test_q4_prefill_follows_its_measurement(monkeypatch, int8_s, want):
    """Where the layers have 4-bit weights, their dense path is the one measured faster at the
    largest probed row count, panels (of the measured panel dtype) against int8 tiles; set on
    every module, kept in the verdict. Without 4-bit layer weights it is not probed."""
    seen = []

    def probe_q4_prefill(q, rows, panel_dtype, repeats=3):
        seen.append((rows, panel_dtype))
        return ProbeResult(1.0, int8_s, (1.0, 1.0), (int8_s, int8_s))

    monkeypatch.setattr(quant_probe, "probe_q4_prefill", probe_q4_prefill)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 16, 64, 256), True)))
    fake = _Recorder(True)
    verdict = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": fake}))
    assert seen == [(256, torch.float32)] and verdict.q4_prefill == want
    assert fake.set_to["q4_prefill"][-1] == want
    assert f"4-bit prefill {want} (panels 1000.00 ms, int8 {int8_s * 1e3:.2f} ms)" in verdict.describe()
    assert Verdict.from_dict(verdict.to_dict()).q4_prefill == want
    seen.clear()
    only_q8 = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": _Recorder(False)}))
    assert seen == [] and only_q8.q4_prefill == "panels"


@pytest.mark.parametrize(("tiles_s", "want"), [(0.5, "tiles"), (1.5, "kernel")])
def test_q4_batches_follow_their_measurement(monkeypatch, tiles_s, want):
    """With 4-bit weights (a logits head counts), decode batches run on the int8 tiles only
    where measured faster than the decode kernel chosen before; set on every 4-bit module."""
    probed = []

    def probe_q4_batches(q, rows=quant_probe.BATCH_ROWS, repeats=3):
        probed.append(rows)
        return ProbeResult(1.0, tiles_s, (1.0, 1.0), (tiles_s, tiles_s))

    monkeypatch.setattr(quant_probe, "probe_q4_batches", probe_q4_batches)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4), True)))
    fake = _Recorder(True)
    verdict = choose(nn.Module(), QuantisedModules(linears={"lm_head": fake}), rows=(1, 4))
    assert probed == [quant_probe.BATCH_ROWS] and verdict.q4_batch == want
    assert fake.set_to["q4_batch"][-1] == want
    assert f"4-bit decode batches {want}" in verdict.describe()
    assert Verdict.from_dict(verdict.to_dict()).q4_batch == want


@pytest.mark.parametrize(("blocked_s", "want"), [(0.5, "blocked"), (1.5, "rows")])
def test_q4_layout_follows_its_measurement(monkeypatch, blocked_s, want):
    """With 4-bit weights the blocked layout is taken only where measured faster (1 and 16
    rows) than the rows layout with the settings chosen before it; set on every 4-bit module,
    kept in the verdict."""
    order = []

    def probe_q4_batches(q, rows=quant_probe.BATCH_ROWS, repeats=3):
        order.append("batches")
        return ProbeResult(1.0, 0.5, (1.0, 1.0), (0.5, 0.5))

    def probe_q4_layout(q, rows=quant_probe.DECODE_ROWS, repeats=3):
        order.append(("layout", rows))
        return ProbeResult(1.0, blocked_s, (1.0, 1.0), (blocked_s, blocked_s))

    monkeypatch.setattr(quant_probe, "probe_q4_batches", probe_q4_batches)
    monkeypatch.setattr(quant_probe, "probe_q4_layout", probe_q4_layout)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4), True)))
    fake = _Recorder(True)
    verdict = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": fake}), rows=(1, 4))
    assert order == ["batches", ("layout", quant_probe.DECODE_ROWS)]
    assert verdict.q4_layout == want and fake.set_to["q4_layout"][-1] == want
    assert f"4-bit layout {want} (rows 1000.00 ms, blocked {blocked_s * 1e3:.2f} ms)" \
        in verdict.describe()
    assert Verdict.from_dict(verdict.to_dict()).q4_layout == want
    order.clear()
    only_q8 = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": _Recorder(False)}),
                     rows=(1, 4))
    assert order == [] and only_q8.q4_layout == "rows"


@pytest.mark.parametrize(("vnni_s", "want"), [(0.5, "vnni"), (1.5, "avx2")])
def test_q4_tiles_follow_their_measurement(monkeypatch, vnni_s, want):
    """Where the VNNI kernels are built and 4-bit layer weights exist, the tiles' instructions
    are measured first (a decode batch and the largest prefill count), set on every 4-bit
    module and kept in the verdict; elsewhere not measured (AVX2)."""
    probed = []

    def probe_q4_tiles(q, rows, repeats=3):
        probed.append(rows)
        return ProbeResult(1.0, vnni_s, (1.0, 1.0), (vnni_s, vnni_s))

    monkeypatch.setattr(quant_probe, "probe_q4_tiles", probe_q4_tiles)
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: True)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 64), True)))
    fake = _Recorder(True)
    verdict = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": fake}),
                     rows=(1, 4, 64))
    assert probed == [(quant_probe.BATCH_ROWS[-1], 64)] and verdict.q4_tiles == want
    assert fake.set_to["q4_tiles"][-1] == want
    assert f"4-bit tiles {want} (avx2 1000.00 ms, vnni {vnni_s * 1e3:.2f} ms)" in verdict.describe()
    assert Verdict.from_dict(verdict.to_dict()).q4_tiles == want
    probed.clear()
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: False)
    plain = choose(nn.Module(), QuantisedModules(linears={"layers.0.o_proj": _Recorder(True)}),
                   rows=(1, 4))
    assert probed == [] and plain.q4_tiles == "avx2"


@pytest.mark.parametrize(("lanes_s", "want"), [(0.5, "lanes"), (1.5, "kernel")])
def test_q8_batch_follows_its_measurement(monkeypatch, lanes_s, want):
    """Where the VNNI kernels are built and 8-bit weights exist (the logits head among them),
    the lanes kernel is measured against the decode kernel on batches of ``LANES_BATCH_ROWS``
    and set on every 8-bit module; elsewhere not measured (the decode kernel)."""
    probed = []

    def probe_q8_batches(q, rows=quant_probe.LANES_BATCH_ROWS, repeats=3):
        probed.append(rows)
        return ProbeResult(1.0, lanes_s, (1.0, 1.0), (lanes_s, lanes_s))

    monkeypatch.setattr(quant_probe, "probe_q8_batches", probe_q8_batches)
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: True)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4), True)))
    head = _Recorder(False)
    verdict = choose(nn.Module(), QuantisedModules(linears={"lm_head": head}), rows=(1, 4))
    assert probed == [quant_probe.LANES_BATCH_ROWS] and verdict.q8_batch == want
    assert head.set_to["q8_batch"][-1] == want
    assert (f"8-bit decode batches {want} (kernel 1000.00 ms, lanes {lanes_s * 1e3:.2f} ms)"
            in verdict.describe())
    assert Verdict.from_dict(verdict.to_dict()).q8_batch == want
    probed.clear()
    q4_only = choose(nn.Module(), QuantisedModules(linears={"lm_head": _Recorder(True)}),
                     rows=(1, 4))
    assert probed == [] and q4_only.q8_batch == "kernel"
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: False)
    assert choose(nn.Module(), QuantisedModules(linears={"lm_head": _Recorder(False)}),
                  rows=(1, 4)).q8_batch == "kernel" and probed == []


@pytest.mark.parametrize(("interleaved_s", "want"), [(0.5, "interleaved"), (1.5, "rows")])
def test_q8_layout_follows_its_measurement(monkeypatch, interleaved_s, want):
    """Where the interleaved kernel is built (AVX2, with or without VNNI) and 8-bit weights
    exist, the interleaved layout is measured against the rows layout (with the 8-bit
    settings chosen before it: the lanes only with VNNI) at ``DECODE_ROWS`` and set on every
    8-bit module; elsewhere not measured (rows)."""
    probed = []

    def probe_q8_layout(q, rows=quant_probe.DECODE_ROWS, repeats=3):
        probed.append((rows, [m.set_to["q8_batch"][-1] for m in q.linears.values()]))
        return ProbeResult(1.0, interleaved_s, (1.0, 1.0), (interleaved_s, interleaved_s))

    monkeypatch.setattr(quant_probe, "probe_q8_layout", probe_q8_layout)
    monkeypatch.setattr(quant_probe, "probe_q8_batches",
                        lambda q, *a, **kw: ProbeResult(1.0, 0.5, (1.0, 1.0), (0.5, 0.5)))
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: True)
    monkeypatch.setattr(quant_probe, "interleaved_available", lambda: True)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4), True)))
    head = _Recorder(False)
    verdict = choose(nn.Module(), QuantisedModules(linears={"lm_head": head}), rows=(1, 4))
    assert probed == [(quant_probe.DECODE_ROWS, ["lanes"])] and verdict.q8_layout == want
    assert head.set_to["q8_layout"][-1] == want
    assert (f"8-bit layout {want} (rows 1000.00 ms, interleaved {interleaved_s * 1e3:.2f} ms)"
            in verdict.describe())
    assert Verdict.from_dict(verdict.to_dict()).q8_layout == want
    probed.clear()
    q4_only = choose(nn.Module(), QuantisedModules(linears={"lm_head": _Recorder(True)}),
                     rows=(1, 4))
    assert probed == [] and q4_only.q8_layout == "rows"
    monkeypatch.setattr(quant_probe, "vnni_available", lambda: False)  # AVX2: no lanes
    avx2 = choose(nn.Module(), QuantisedModules(linears={"lm_head": _Recorder(False)}),
                  rows=(1, 4))
    assert probed == [(quant_probe.DECODE_ROWS, ["kernel"])] and avx2.q8_layout == want
    probed.clear()
    monkeypatch.setattr(quant_probe, "interleaved_available", lambda: False)
    assert choose(nn.Module(), QuantisedModules(linears={"lm_head": _Recorder(False)}),
                  rows=(1, 4)).q8_layout == "rows" and probed == []


@pytest.mark.parametrize(("amx_s", "from8_s", "want"),
                         [(0.5, 0.5, ("amx", "8")), (0.5, 1.5, ("amx", "16")),
                          (1.5, 0.5, ("vnni", "16"))])
def test_q8_tiles_follow_their_measurements(monkeypatch, amx_s, from8_s, want):
    """Where the AMX tiles are available and 8-bit weights are stored interleaved, their VNNI
    lanes are measured against AMX tiles, and with AMX, AMX from 16 rows against from 8 (the
    second probe only then); elsewhere neither is measured (vnni, 16)."""
    probed = []

    def timed(name, s):
        def probe(q, *a, **kw):
            probed.append(name)
            return ProbeResult(1.0, s, (1.0, 1.0), (s, s))
        return probe

    monkeypatch.setattr(quant_probe, "probe_q8_tiles", timed("tiles", amx_s))
    monkeypatch.setattr(quant_probe, "probe_q8_amx_from", timed("from", from8_s))
    monkeypatch.setattr(quant_probe, "probe_q8_layout",
                        lambda q, *a, **kw: ProbeResult(1.0, 0.5, (1.0, 1.0), (0.5, 0.5)))
    monkeypatch.setattr(quant_probe, "interleaved_available", lambda: True)
    monkeypatch.setattr(quant_probe, "amx_available", lambda: True)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4), True)))
    head = _Recorder(False)
    head.interleaved = True  # what choose(q8_layout="interleaved") does to a real module
    verdict = choose(nn.Module(), QuantisedModules(linears={"lm_head": head}), rows=(1, 4))
    assert probed == (["tiles", "from"] if want[0] == "amx" else ["tiles"])
    assert (verdict.q8_tiles, verdict.q8_amx_from) == want
    assert (head.set_to["q8_tiles"][-1], head.set_to["q8_amx_from"][-1]) == want
    back = Verdict.from_dict(verdict.to_dict())
    assert (back.q8_tiles, back.q8_amx_from) == want
    probed.clear()
    head.interleaved = False  # the rows layout: nothing to measure
    rows = choose(nn.Module(), QuantisedModules(linears={"lm_head": head}), rows=(1, 4))
    assert probed == [] and (rows.q8_tiles, rows.q8_amx_from) == ("vnni", "16")
    head.interleaved = True
    monkeypatch.setattr(quant_probe, "amx_available", lambda: False)
    assert choose(nn.Module(), QuantisedModules(linears={"lm_head": head}),
                  rows=(1, 4)).q8_tiles == "vnni" and probed == []


@pytest.mark.parametrize(("amx_s", "from16_s", "want"),
                         [(0.5, 0.5, ("on", "16")), (0.5, 1.5, ("on", "33")),
                          (1.5, 0.5, ("off", "33"))])
def test_q4_amx_follows_its_measurements(monkeypatch, amx_s, from16_s, want):
    """Where the AMX tiles are available and the layers have 4-bit weights, their blocked
    tiles are measured against AMX tiles on a prefill chunk (the largest probed row count),
    and with AMX, AMX from 33 rows against from 16 (the second probe only then); elsewhere
    neither is measured (off, 33)."""
    probed = []

    def timed(name, s):
        def probe(q, *a, **kw):
            probed.append((name, a[0] if a else kw.get("rows")))
            return ProbeResult(1.0, s, (1.0, 1.0), (s, s))
        return probe

    monkeypatch.setattr(quant_probe, "probe_q4_amx", timed("amx", amx_s))
    monkeypatch.setattr(quant_probe, "probe_q4_amx_from", timed("from", from16_s))
    monkeypatch.setattr(quant_probe, "amx_available", lambda: True)
    monkeypatch.setattr(quant_probe, "probe", _fake_probe(dict.fromkeys((1, 4, 256), True)))
    layer = _Recorder(True)
    q = QuantisedModules(linears={"layers.0.o_proj": layer})
    verdict = choose(nn.Module(), q, rows=(1, 4, 256))
    assert probed == ([("amx", 256), ("from", None)] if want[0] == "on" else [("amx", 256)])
    assert (verdict.q4_amx, verdict.q4_amx_from) == want
    assert (layer.set_to["q4_amx"][-1], layer.set_to["q4_amx_from"][-1]) == want
    back = Verdict.from_dict(verdict.to_dict())
    assert (back.q4_amx, back.q4_amx_from) == want
    assert "4-bit AMX tiles " + want[0] in verdict.describe()
    probed.clear()
    head = QuantisedModules(linears={"lm_head": _Recorder(True)})  # no 4-bit layers
    assert choose(nn.Module(), head, rows=(1, 4)).q4_amx == "off" and probed == []
    monkeypatch.setattr(quant_probe, "amx_available", lambda: False)
    assert choose(nn.Module(), q, rows=(1, 4, 256)).q4_amx == "off" and probed == []


def test_the_real_setting_probes_run_and_restore_the_modules():
    from engine.quantization.linear import (
        QuantLinear,
        amx_available,
        interleaved_available,
        quant_kernels,
        vnni_available,
    )
    from engine.quantization.rtn import quantise

    if quant_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    g = torch.Generator().manual_seed(0)
    lin = QuantLinear(quantise(torch.randn(48, 64, generator=g), "int4", 32))
    q = QuantisedModules(linears={"layers.0.o_proj": lin})
    result = REAL_PANELS(q, 40, 1)
    assert result.float_s > 0 and result.quant_s > 0 and lin.kernels.panel_dtype == torch.float32
    result = REAL_Q4_PREFILL(q, 40, torch.float32, 1)
    assert result.float_s > 0 and result.quant_s > 0 and lin.kernels.q4_prefill == "panels"
    result = REAL_Q4_BATCHES(q, (8, 9), 1)
    assert result.float_s > 0 and result.quant_s > 0 and lin.kernels.q4_batch == "kernel"
    qs = lin.qs.clone()
    result = REAL_Q4_LAYOUT(q, (1, 9), 1)
    assert result.float_s > 0 and result.quant_s > 0 and lin.kernels.q4_layout == "rows"
    assert torch.equal(lin.qs, qs)
    if vnni_available():
        assert REAL_KERNELS(q, True, (1, 3), 1).quant_s > 0 and lin.kernels.q4_kernel == "base"
        assert REAL_Q4_TILES(q, (3, 40), 1).quant_s > 0 and lin.kernels.q4_tiles == "avx2"
        lin8 = QuantLinear(quantise(torch.randn(48, 64, generator=g), "int8", 32))
        q8 = QuantisedModules(linears={"layers.0.o_proj": lin8})
        assert REAL_KERNELS(q8, False, (1, 3), 1).quant_s > 0 and lin8.kernels.q8_kernel == "base"
        assert REAL_Q8_BATCHES(q8, (8, 9), 1).quant_s > 0 and lin8.kernels.q8_batch == "kernel"
    if interleaved_available():
        lin8 = QuantLinear(quantise(torch.randn(48, 64, generator=g), "int8", 32))
        q8 = QuantisedModules(linears={"layers.0.o_proj": lin8})
        qs8 = lin8.qs.clone()
        assert REAL_Q8_LAYOUT(q8, (1, 9), 1).quant_s > 0 and lin8.kernels.q8_layout == "rows"
        assert torch.equal(lin8.qs, qs8)
    if amx_available():
        lin8.choose(q8_layout="interleaved")
        assert REAL_Q8_TILES(q8, (16,), 1).quant_s > 0 and lin8.kernels.q8_tiles == "vnni"
        lin8.choose(q8_tiles="amx")
        assert REAL_Q8_AMX_FROM(q8, (8,), 1).quant_s > 0 and lin8.kernels.q8_amx_from == "16"
        # the 4-bit layers measured blocked, their rows layout restored
        assert REAL_Q4_AMX(q, 40, 1).quant_s > 0 and lin.kernels.q4_amx == "off"
        assert lin.kernels.q4_layout == "rows" and torch.equal(lin.qs, qs)
        lin.choose(q4_amx="on")
        assert REAL_Q4_AMX_FROM(q, (16,), 1).quant_s > 0 and lin.kernels.q4_amx_from == "33"
        assert lin.kernels.q4_layout == "rows" and torch.equal(lin.qs, qs)
