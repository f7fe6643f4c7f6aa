"""``dtype="auto"`` on the CPU (engine/runner/dtype_probe.py, ``resolve_dtype``): float32 or
bfloat16 by a measurement of the model's own shapes, never by the CPU's flags; float32 where
packed weights serve."""

from __future__ import annotations

import pytest
import torch

from engine.runner import dtype_probe
from engine.runner.dtype_choice import resolve_dtype

CONFIG = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_QUANT_REPROBE", raising=False)


def test_layer_shapes_are_the_fused_projections():
    assert dtype_probe.layer_shapes(CONFIG) == [(64, 64 + 2 * 32), (64, 64), (64, 320), (160, 64)]


@pytest.mark.parametrize("faster", [torch.float32, torch.bfloat16])
def test_auto_follows_the_measurement_and_caches_it(monkeypatch, faster):
    calls = []

    def request_seconds(cfg):
        calls.append(cfg)
        return {dt: (1.0 if dt == faster else 3.0) for dt in dtype_probe.CANDIDATES}

    monkeypatch.setattr(dtype_probe, "request_seconds", request_seconds)
    assert resolve_dtype("auto", CPU, "auto", CONFIG) == faster
    assert len(calls) == 2  # measured twice; the two agree, so the verdict is cached
    assert resolve_dtype("auto", CPU, "auto", CONFIG) == faster and len(calls) == 2


def test_disagreeing_measurements_are_cached_too_and_force_measures_again(monkeypatch):
    """A busy machine's disagreeing runs still end the probing (the better best run is cached,
    so the next start is fast); ``cpu_probe="force"`` measures again, ``"off"`` never."""
    flip = iter([0.5, 2.0, 3.0, 4.0])

    def request_seconds(cfg):
        return {torch.float32: 1.0, torch.bfloat16: next(flip)}

    monkeypatch.setattr(dtype_probe, "request_seconds", request_seconds)
    assert resolve_dtype("auto", CPU, "auto", CONFIG) == torch.bfloat16  # best of both
    assert resolve_dtype("auto", CPU, "auto", CONFIG) == torch.bfloat16  # cached: no call
    assert resolve_dtype("auto", CPU, "auto", CONFIG, cpu_probe="force") == torch.float32
    assert resolve_dtype("auto", CPU, "auto", CONFIG) == torch.float32  # the new entry
    assert resolve_dtype("auto", CPU, "auto", CONFIG, cpu_probe="off") == torch.float32
    with pytest.raises(StopIteration):  # only force measures again; the iterator is spent
        resolve_dtype("auto", CPU, "auto", CONFIG, cpu_probe="force")


def test_packed_weights_and_explicit_dtypes_are_not_probed(monkeypatch):
    monkeypatch.setattr(dtype_probe, "request_seconds", lambda cfg: pytest.fail("probed"))
    assert resolve_dtype("auto", CPU, "auto", CONFIG, packed_checkpoint=True) == torch.float32
    assert resolve_dtype("auto", CPU, "int4", CONFIG) == torch.float32
    assert resolve_dtype("bfloat16", CPU, "auto", CONFIG) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32  # no config to measure


def test_the_real_measurement_runs_and_times_both_dtypes():
    best = dtype_probe.time_dtypes(dtype_probe.layer_shapes(CONFIG), rows=4, repeats=2)
    assert set(best) == set(dtype_probe.CANDIDATES) and all(t > 0 for t in best.values())
