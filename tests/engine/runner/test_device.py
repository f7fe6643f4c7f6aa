"""Device selection: auto falls back to the CPU, loudly when an NVIDIA GPU is there that torch
cannot use; explicit CUDA devices that cannot be used are refused with the diagnosis."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.runner import device as dev

SAMPLE_580 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.03  Wed Jul 16 22:10:50 "
              "UTC 2025\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
SAMPLE_550_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  "
                   "Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Feb 22 01:25:25 UTC 2024\n")


@pytest.fixture
def no_nvidia(monkeypatch, tmp_path):
    """A machine with no NVIDIA driver, device node or nvidia-smi, and torch seeing no GPU."""
    monkeypatch.setattr(dev, "PROC_DRIVER_VERSION", tmp_path / "no-proc-version")
    monkeypatch.setattr(dev, "DEVICE_NODE", tmp_path / "no-nvidia0")
    monkeypatch.setattr(dev, "_nvidia_smi", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


@pytest.fixture
def cuda12_driver(no_nvidia, monkeypatch):
    """A CUDA-12 driver (550) is loaded, torch is a CUDA 13 build and so sees no GPU."""
    (no_nvidia / "version").write_text(SAMPLE_550_OPEN)
    monkeypatch.setattr(dev, "PROC_DRIVER_VERSION", no_nvidia / "version")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    return "550.54.14"


@pytest.mark.parametrize("text,expected", [
    (SAMPLE_580, "580.159.03"),
    (SAMPLE_550_OPEN, "550.54.14"),
    ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  535.104.05  Sat Aug 19 ...\n",
     "535.104.05"),
    ("something else entirely\n", None),
    ("", None),
])
def test_parse_driver_version(text, expected):
    assert dev.parse_driver_version(text) == expected


def test_driver_version_read_from_proc(no_nvidia, monkeypatch):
    assert dev.nvidia_driver_version() is None
    assert not dev.nvidia_gpu_present()
    (no_nvidia / "version").write_text(SAMPLE_580)
    monkeypatch.setattr(dev, "PROC_DRIVER_VERSION", no_nvidia / "version")
    assert dev.nvidia_driver_version() == "580.159.03"
    assert dev.nvidia_gpu_present()


def test_device_node_or_nvidia_smi_alone_means_present(no_nvidia, monkeypatch):
    (no_nvidia / "nvidia0").touch()
    monkeypatch.setattr(dev, "DEVICE_NODE", no_nvidia / "nvidia0")
    assert dev.nvidia_gpu_present()
    monkeypatch.setattr(dev, "DEVICE_NODE", no_nvidia / "gone")
    monkeypatch.setattr(dev, "_nvidia_smi", lambda: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(dev, "_query_nvidia_smi", lambda exe: "570.86.15")
    assert dev.nvidia_gpu_present()
    assert dev.nvidia_driver_version() == "570.86.15"


def test_auto_without_nvidia_is_cpu_and_quiet(no_nvidia, caplog):
    with caplog.at_level(logging.DEBUG, logger="kvserve.engine"):
        assert dev.resolve_device("auto") == torch.device("cpu")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_with_unusable_nvidia_gpu_warns_then_uses_cpu(cuda12_driver, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        assert dev.resolve_device("auto") == torch.device("cpu")
    warnings = [r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "kvserve.engine"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert cuda12_driver in text
    assert torch.__version__ in text and "CUDA 13.0" in text
    assert "driver >= 580" in text
    assert "torch==2.10" in text and "whl/cu126" in text
    assert "CPU" in text


def test_auto_with_cpu_only_torch_names_the_build(cuda12_driver, monkeypatch, caplog):
    monkeypatch.setattr(torch.version, "cuda", None)
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        assert dev.resolve_device("auto") == torch.device("cpu")
    assert "CPU-only build" in caplog.text and cuda12_driver in caplog.text


def test_auto_with_gpus_hidden_on_purpose_does_not_warn(cuda12_driver, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with caplog.at_level(logging.DEBUG, logger="kvserve.engine"):
        assert dev.resolve_device("auto") == torch.device("cpu")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "CUDA_VISIBLE_DEVICES" in dev.cuda_unavailable_reason()


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:1"])
def test_explicit_cuda_unavailable_is_refused_with_the_diagnosis(cuda12_driver, name):
    with pytest.raises(ValueError) as err:
        dev.resolve_device(name)
    msg = str(err.value)
    assert repr(name) in msg and cuda12_driver in msg
    assert "driver >= 580" in msg and "whl/cu126" in msg


def test_explicit_cuda_without_any_nvidia_says_so(no_nvidia):
    with pytest.raises(ValueError, match="no NVIDIA driver found"):
        dev.resolve_device("cuda")


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_cuda_index_beyond_the_visible_gpus_is_refused(one_gpu):
    with pytest.raises(ValueError, match=r"'cuda:3'.*1 GPU"):
        dev.resolve_device("cuda:3")
    with pytest.raises(ValueError, match="cuda:1"):
        dev.resolve_device("cuda:1")


def test_cuda_devices_come_back_indexed(one_gpu):
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)


def test_cpu_and_unknown_names():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        dev.resolve_device("gpu0")


def test_set_device_for_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    dev.set_device_for_thread(torch.device("cpu"))
    assert calls == []
    dev.set_device_for_thread(torch.device("cuda", 2))
    dev.set_device_for_thread(torch.device("cuda"))
    assert calls == [torch.device("cuda", 2), torch.device("cuda", 0)]
