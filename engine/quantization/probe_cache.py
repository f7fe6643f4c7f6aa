"""Per-machine cache of the quantised-vs-float verdict (``quantization=auto``'s start-up probe).

Measuring again at every start costs seconds and, on a busy machine, can mislead, so every
verdict is stored (one whose runs disagreed decided by their medians) and later starts reuse
it. ``cpu_probe`` (``--cpu-probe``): ``cached`` (default) reuses an entry and measures where
there is none, ``background`` (``kvserve serve``'s default) too, but after the server is ready, ``force`` measures again and replaces it, ``off`` neither measures nor reads
(the defaults serve); ``KVSERVE_QUANT_REPROBE=1`` is ``force``. The key covers everything the
measurement depends on: the CPU (model name and flags), the torch threads and version, the CPU
kernels' and the probe's sources, the instruction sets the paths may use
(``KVSERVE_CPU_MARCH``, ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``) and the modules' shapes and formats. A file that cannot be read or
written is ignored (the probe runs). Entries live in ``<cache dir>/quant-probe/<key>.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from engine import envs
from engine.cache_dir import default_cache_dir
from engine.cpu.build import cpu_identity

logger = logging.getLogger("kvserve.engine")
_CSRC = Path(__file__).resolve().parents[1] / "cpu" / "csrc"


# A verdict measured under one set of instruction caps says nothing about another (envs.py).
ISA_CAPS = envs.ISA_CAP_VARIABLES


def _kernel_sources() -> str:
    """A hash of the kernels' sources and of the probe itself (what it measures, and how)."""
    h = hashlib.sha256()
    for path in [*sorted(_CSRC.glob("*")), Path(__file__).with_name("probe.py")]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(modules_signature: str) -> str:
    """The key of a verdict for modules of ``modules_signature`` on this machine, now."""
    parts = [cpu_identity(), str(torch.get_num_threads()), torch.__version__,
             _kernel_sources(), *envs.isa_caps(), modules_signature]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return default_cache_dir() / "quant-probe" / f"{key}.json"


def load(key: str, mode: str = "cached") -> dict | None:
    """The stored entry (``{"verdict": ..., "measured_at": ...}``), or None (also for ``mode``
    ``force``/``off``, or ``KVSERVE_QUANT_REPROBE=1``; ``background`` reads like ``cached``)."""
    if mode not in ("cached", "background") or envs.quant_reprobe():
        return None
    try:
        return json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None


def save(key: str, verdict: dict) -> None:
    path = _path(key)
    entry = {"verdict": verdict, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        tmp.replace(path)
    except OSError as exc:
        logger.debug("quantization probe not cached (%s)", exc)
