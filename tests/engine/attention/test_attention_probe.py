"""Attention backend selection: "auto" uses Triton on CUDA only when a probe kernel compiled and
ran there, otherwise falls back to torch with a WARNING; an explicit "triton" refuses.

CUDA is faked (a ``torch.device("cuda", 0)`` needs no GPU) and the probe is monkeypatched;
one real probe runs on the CPU, in Triton's interpreter, where that is available.
"""

from __future__ import annotations

import logging

import pytest
import torch

import engine.attention.backend as attention_backend
from engine.attention.backend import get_attention_backend, probe_triton

CUDA0 = torch.device("cuda", 0)
BROKEN = ("a probe kernel failed: RuntimeError: Failed to find C compiler. Please specify via "
          "CC environment variable.")


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    attention_backend._probe_triton_cached.cache_clear()
    yield
    attention_backend._probe_triton_cached.cache_clear()


def _probe_returning(result, calls=None):
    def fake(device):
        if calls is not None:
            calls.append(device)
        return result
    return fake


def test_auto_on_cuda_falls_back_to_torch_with_a_warning(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(attention_backend, "probe_triton", _probe_returning(BROKEN, calls))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        backend = get_attention_backend("auto", CUDA0)
    assert backend.name == "torch"
    assert calls == [CUDA0]
    (record,) = [r for r in caplog.records if r.name == "kvserve.engine"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "torch backend" in message and "cuda:0" in message
    assert "Failed to find C compiler" in message


def test_auto_on_cuda_uses_triton_when_the_probe_passes(monkeypatch, caplog):
    pytest.importorskip("triton")
    monkeypatch.setattr(attention_backend, "probe_triton", _probe_returning(None))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        backend = get_attention_backend("auto", CUDA0)
    assert backend.name == "triton"
    assert not caplog.records


def test_explicit_triton_refuses_with_the_reason(monkeypatch):
    monkeypatch.setattr(attention_backend, "probe_triton", _probe_returning(BROKEN))
    with pytest.raises(ValueError, match="'triton' cannot run on cuda:0.*Failed to find C"):
        get_attention_backend("triton", CUDA0)


def test_auto_on_cpu_is_torch_without_probing(monkeypatch):
    def no_probe(device):
        raise AssertionError("auto must not probe Triton on a CPU")

    monkeypatch.setattr(attention_backend, "probe_triton", no_probe)
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert get_attention_backend("torch", CUDA0).name == "torch"


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", torch.device("cpu"))


def test_probe_reports_a_launch_failure_with_a_toolchain_hint_and_caches_it(monkeypatch):
    pytest.importorskip("triton")
    import kvserve_kernels.probe

    calls = []

    def failing_launch(device):
        calls.append(device)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment "
                           "variable.\nline two\nline three\nline four: compiler output")

    monkeypatch.setattr(kvserve_kernels.probe, "run_probe", failing_launch)
    reason = probe_triton(CUDA0)
    assert reason is not None and reason.startswith("a probe kernel failed: RuntimeError: ")
    assert "Failed to find C compiler" in reason and "line three" in reason
    assert "line four" not in reason  # only the first lines of a long compiler error
    assert "gcc" in reason and "python3-dev" in reason
    assert probe_triton(CUDA0) == reason
    assert calls == [CUDA0]  # cached per device: one launch


def test_probe_passes_for_a_correct_launch(monkeypatch):
    pytest.importorskip("triton")
    import kvserve_kernels.probe

    monkeypatch.setattr(kvserve_kernels.probe, "run_probe", lambda device: None)
    assert probe_triton(CUDA0) is None


def test_probe_catches_a_launch_that_computes_nothing(monkeypatch):
    pytest.importorskip("triton")
    import kvserve_kernels.probe

    class SilentKernel:  # launches "succeed" but write nothing
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(kvserve_kernels.probe, "_add_one_kernel", SilentKernel())
    with pytest.raises(RuntimeError, match="computed"):
        kvserve_kernels.probe.run_probe(torch.device("cpu"))


def test_real_probe_on_cpu_under_the_interpreter():
    pytest.importorskip("triton")
    if not attention_backend._triton_interpreting():
        pytest.skip("Triton's interpreter is not active in this process")
    assert probe_triton(torch.device("cpu")) is None
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
