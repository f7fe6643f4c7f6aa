"""Choosing the torch device, and saying why a GPU that is there cannot be used.

The common failure on GPU hosts is not a missing GPU but a torch wheel that cannot use it: PyPI's
torch 2.11-2.13 Linux wheels are built for CUDA 13 and need NVIDIA driver >= 580, and a ``+cpu``
build never sees a GPU. ``device="auto"`` then falls back to the CPU; this module makes that
fallback loud and tells the user which torch to install. The probes are small functions reading
module-level paths so that tests can fake a driver with monkeypatch.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import torch

from engine import envs

logger = logging.getLogger("kvserve.engine")

# Where the NVIDIA kernel module announces itself; both exist in a `--gpus all` container too.
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
DEVICE_NODE = Path("/dev/nvidia0")

# Oldest driver each CUDA major version runs on (12.x with minor-version compatibility).
MIN_DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}

TORCH_ADVICE = (
    "PyPI's torch 2.11-2.13 Linux wheels are built for CUDA 13 and need NVIDIA driver >= 580. "
    "On a CUDA-12 driver (525-579) install torch 2.10, the newest built for CUDA 12: "
    "pip install 'torch==2.10.*' --index-url https://download.pytorch.org/whl/cu126 . "
    "A CPU-only build (+cpu) never sees a GPU."
)

_VERSION_RE = re.compile(r"\s(\d+\.\d+(?:\.\d+)?)\s")


def parse_driver_version(text: str) -> str | None:
    """The driver version in the text of /proc/driver/nvidia/version, e.g. "580.159.03"."""
    for line in text.splitlines():
        if line.startswith("NVRM version"):
            match = _VERSION_RE.search(line + " ")
            return match.group(1) if match else None
    return None


def _nvidia_smi() -> str | None:
    return shutil.which("nvidia-smi")


def _query_nvidia_smi(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0].strip() if out.strip() else ""
    return first if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", first) else None


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA driver's version, or None when no driver is found.

    Read from /proc/driver/nvidia/version; where that is absent (WSL) nvidia-smi is asked.
    """
    try:
        version = parse_driver_version(PROC_DRIVER_VERSION.read_text())
    except OSError:
        version = None
    if version is None and (exe := _nvidia_smi()) is not None:
        version = _query_nvidia_smi(exe)
    return version


def nvidia_gpu_present() -> bool:
    """True when this machine shows an NVIDIA driver or device, whatever torch thinks."""
    return PROC_DRIVER_VERSION.exists() or DEVICE_NODE.exists() or _nvidia_smi() is not None


def _driver_major(version: str | None) -> int | None:
    try:
        return int(version.split(".")[0]) if version else None
    except ValueError:
        return None


def _gpus_hidden_by_env() -> str | None:
    """The CUDA_VISIBLE_DEVICES value when it deliberately hides every GPU, else None."""
    value = envs.cuda_visible_devices()
    if value is not None and (value.strip() == "" or value.strip().startswith("-1")):
        return value
    return None


def cuda_unavailable_reason() -> str:
    """Why torch sees no CUDA GPU here, and what to do about it, in one paragraph."""
    torch_cuda = torch.version.cuda
    driver = nvidia_driver_version()
    facts = (f"torch {torch.__version__} (built for CUDA {torch_cuda})" if torch_cuda
             else f"torch {torch.__version__} (a CPU-only build)")
    facts += f", NVIDIA driver {driver}" if driver else (
        ", NVIDIA GPU present, driver version unknown" if nvidia_gpu_present()
        else ", no NVIDIA driver found")
    hidden = _gpus_hidden_by_env()
    if hidden is not None:
        return f"{facts}: CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU."
    if not nvidia_gpu_present():
        return (f"{facts}: no /proc/driver/nvidia/version, /dev/nvidia0 or nvidia-smi on this "
                "machine (in a container, run it with `--gpus all`).")
    if torch_cuda is None:
        cause = "a CPU-only torch build never sees a GPU"
    else:
        cuda_major = _driver_major(torch_cuda)
        need = MIN_DRIVER_FOR_CUDA.get(cuda_major or 0)
        have = _driver_major(driver)
        if need is not None and have is not None and have < need:
            cause = (f"CUDA {torch_cuda} needs driver >= {need}, this driver is {driver}")
        else:
            cause = "torch could not initialise CUDA (see torch's own warning above)"
    return f"{facts}: {cause}. {TORCH_ADVICE}"


def resolve_device(name: str) -> torch.device:
    """The device ``name`` asks for: "auto", "cpu", "cuda" or "cuda:N".

    "auto" is the first GPU when torch sees one, else the CPU, with a WARNING when an NVIDIA GPU
    is present that torch cannot use. An explicit CUDA device that cannot be used is refused with
    a ValueError saying why. CUDA devices always come back with an index ("cuda" means cuda:0),
    which is what ``torch.cuda.set_device`` needs and what tensors report.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if _gpus_hidden_by_env() is not None:
            logger.info("device=auto: CUDA_VISIBLE_DEVICES hides every GPU; using the CPU")
        elif nvidia_gpu_present():
            logger.warning("device=auto: an NVIDIA GPU is present but torch cannot use it; "
                           "FALLING BACK TO THE CPU, which is far slower. %s",
                           cuda_unavailable_reason())
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from e
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA GPU: "
                         f"{cuda_unavailable_reason()}")
    index = 0 if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {name!r} was asked for but torch sees {count} GPU(s) "
                         f"(cuda:0 to cuda:{count - 1}); CUDA_VISIBLE_DEVICES renumbers them "
                         "from 0")
    return torch.device("cuda", index)


def set_device_for_thread(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread; a no-op off CUDA.

    Triton and torch launch on the thread's current device, and every new thread starts on
    cuda:0, so each thread that launches GPU work calls this first.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", 0))
