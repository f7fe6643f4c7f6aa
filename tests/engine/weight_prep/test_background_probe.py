"""Issue 66 item 1: serve first, tune later (``--cpu-probe background``).

A packed GGUF with no cached verdict loads on the default kernel settings; the probe then runs
in turns while the engine is idle, on the engine's thread (OpenMP regions cost there what they
cost a step), the modules serve as loaded between turns, and its verdict
is switched in between requests, leaving the model exactly as a start with that verdict cached
would (the same kernels, the same weight bytes) and, under batch invariance, the same tokens.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.llm import LLM
from engine.params.sampling import SamplingParams
from engine.quantization import probe_cache
from engine.quantization.linear import QuantLinear, quant_kernels
from engine.quantization.verdict import SETTINGS
from engine.weight_prep import background
from tests.support.tiny_models import _make_llama_gguf

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="needs the CPU kernels")

PROMPTS = [[1, 5, 9, 14, 3, 7], [2, 8, 8, 30, 41, 11, 6, 19, 4], [12, 40, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bg-probe") / "tiny.Q4.gguf"
    _make_llama_gguf(path, tied=True, quantised=True)
    return path


@pytest.fixture
def store(monkeypatch):
    """The probe cache as a dict: empty at first (this machine has no verdict)."""
    saved: dict[str, dict] = {}
    monkeypatch.setattr(probe_cache, "load",
                        lambda key, mode="cached": {"verdict": saved[key]}
                        if key in saved and mode in ("cached", "background") else None)
    monkeypatch.setattr(probe_cache, "save", lambda key, verdict: saved.__setitem__(key, verdict))
    return saved


@pytest.fixture
def decisive(monkeypatch):
    """Every timed pass still runs, but the second option always measures twice as fast: the
    verdict is every measured setting's second option, its runs agreeing (so it is cached)."""
    from engine.quantization import probe as quant_probe

    def timer(run, side: int) -> float:
        run()
        return (1.0, 0.5)[side]

    monkeypatch.setattr(quant_probe, "_TIMER", [timer])


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _state(llm: LLM) -> list[tuple]:
    """Every packed linear's kernels, invariance and weight bytes."""
    return [(name, m.kernels, m.batch_invariant,
             *[(t.dtype, tuple(t.shape), t.flatten().view(torch.uint8).sum().item())
               for t in (m.qs, m.d) if t is not None])
            for name, m in llm.engine.runner.model.named_modules() if isinstance(m, QuantLinear)]


def test_defaults_serve_until_the_verdict_is_switched_in_between_requests(gguf, store,
                                                                          decisive):
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as llm:
        runner = llm.engine.runner
        probe = runner.background
        assert probe is not None and runner.quant_verdict.pending == probe.key
        assert runner.quant_verdict.settings == {} and store == {}
        serving = _state(llm)
        before = _tokens(llm)
        probe.turn_s = 0.0  # a turn per timed pass: many turns, a request between two
        assert runner.idle_work() and not probe.finished
        runner.suspend_idle_work()
        assert _state(llm) == serving  # between turns the model is as it was loaded
        assert _tokens(llm) == before
        turns = 1
        while runner.idle_work():
            turns += 1
        assert turns > 3 and runner.background is None and probe.switched
        verdict = runner.quant_verdict
        assert verdict.settings and verdict.pending is None and verdict.confirmed
        changed = [k for k, s in verdict.settings.items() if s.value != SETTINGS[k][1][0]]
        assert changed == list(verdict.settings)  # every setting off its default
        assert store[probe.key]["settings"].keys() == verdict.settings.keys()  # cached
        llm.engine.reset_prefix_cache()
        assert _tokens(llm) == before  # batch-invariant: the same floats on every setting
        switched = _state(llm)
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as fresh:
        assert fresh.engine.runner.background is None  # the cached verdict, applied at load
        assert {k: s.value for k, s in fresh.engine.runner.quant_verdict.settings.items()} == \
            {k: s.value for k, s in verdict.settings.items()}
        assert _state(fresh) == switched


def test_over_its_limit_the_defaults_stay_and_nothing_is_cached(gguf, store, caplog):
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as llm:
        runner = llm.engine.runner
        serving = _state(llm)
        runner.background.limit_s = 0.0
        with caplog.at_level("WARNING", "kvserve.engine"):
            while runner.idle_work():
                pass
        assert "over its 0 s limit" in caplog.text
        assert store == {} and _state(llm) == serving
        assert runner.quant_verdict.settings == {}


def test_closing_mid_probe_ends_it_with_the_model_as_loaded(gguf, store):
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as llm:
        runner = llm.engine.runner
        probe = runner.background
        serving = _state(llm)
        probe.turn_s = 0.0
        runner.idle_work()
        runner.close()
        assert probe.finished and probe._glet.dead
        assert _state(llm) == serving and store == {}


def test_cached_measures_before_serving_and_float_is_not_probed_for_packed_weights(gguf, store,
                                                                                   decisive):
    with LLM(str(gguf), max_model_len=128, cpu_probe="cached") as llm:
        verdict = llm.engine.runner.quant_verdict
        assert llm.engine.runner.background is None and verdict.pending is None
        # float32 copies of 4-bit weights exceed quantization=auto's memory factor: the row
        # counts are not probed against float (the linears, packed as panels, count too)
        assert verdict.mode == "quant" and verdict.probes == {}
        assert store  # measured now, cached


def test_the_engine_loop_runs_the_probe_when_idle_and_serves_meanwhile(gguf, store, decisive,
                                                                       monkeypatch):
    import threading

    from engine.quantization import probe as quant_probe

    threads = set()
    alternate = quant_probe._alternate

    def on_which_thread(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return alternate(*args, **kwargs)

    monkeypatch.setattr(quant_probe, "_alternate", on_which_thread)
    monkeypatch.setattr("engine.async_engine.IDLE_GRACE_S", 0.0)
    with LLM(str(gguf), max_model_len=128, cpu_probe="off") as ref:
        want = _tokens(ref)
    from engine.config.engine import EngineConfig

    engine = AsyncEngine(EngineConfig.from_overrides(model=str(gguf), max_model_len=128,
                                                     cpu_probe="background"))
    runner = engine.core.runner
    probe = runner.background
    probe.turn_s = 0.0

    async def one(prompt: list[int]):
        async for out in engine.generate(prompt, GREEDY):
            last = out
        return list(last.outputs[0].token_ids)

    async def ask() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    loop_thread = engine._thread.name
    try:
        got = asyncio.run(ask())  # served whatever the probe's progress
        deadline = time.monotonic() + 300
        while runner.background is not None:
            assert time.monotonic() < deadline and engine.is_healthy
            time.sleep(0.05)
        assert probe.switched and probe.verdict is not None
        after = asyncio.run(ask())
    finally:
        engine.stop()
    assert got == want and after == want
    assert threads == {loop_thread}  # timed on the engine's thread, none of its own


def test_kvserve_serve_defaults_to_background_and_a_config_file_wins(tmp_path):
    from server.config_file import SERVE_DEFAULTS, resolve

    assert resolve({}, None, SERVE_DEFAULTS)[0].cpu_probe == "background"
    assert resolve({}, None)[0].cpu_probe == "cached"  # the offline LLM's default
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu-probe: cached\n")
    assert resolve({}, cfg, SERVE_DEFAULTS)[0].cpu_probe == "cached"
    assert resolve({"cpu_probe": "off"}, cfg, SERVE_DEFAULTS)[0].cpu_probe == "off"


def test_a_probe_error_keeps_the_defaults(gguf, store, monkeypatch, caplog):
    def broken(q, rows=(), on_setting=None):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(background, "measure_settings", broken)
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as llm:
        runner = llm.engine.runner
        serving = _state(llm)
        with caplog.at_level("WARNING", "kvserve.engine"):
            while runner.idle_work():
                pass
        assert "failed (RuntimeError: kernel exploded)" in caplog.text
        assert _state(llm) == serving and store == {}


def test_packed_only_weights_are_probed_in_the_background_and_cached(gguf, store, decisive,
                                                                     monkeypatch):
    """A GGUF whose float copies would not fit (forced here) never builds them: its settings
    wait for the background probe too, and later starts reuse the cached verdict."""
    monkeypatch.setenv("KVSERVE_QUANT_PACKED_ONLY", "1")
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as llm:
        runner = llm.engine.runner
        assert runner.background is not None and runner.quant_verdict.settings == {}
        before = _tokens(llm)
        while runner.idle_work():
            pass
        assert runner.quant_verdict.settings and store
        llm.engine.reset_prefix_cache()
        assert _tokens(llm) == before
    with LLM(str(gguf), max_model_len=128, cpu_probe="background") as again:
        assert again.engine.runner.background is None
        assert again.engine.runner.quant_verdict.settings.keys() == \
            runner.quant_verdict.settings.keys()
    with LLM(str(gguf), max_model_len=128, cpu_probe="off") as off:
        assert off.engine.runner.quant_verdict.settings == {}  # off measures nothing
