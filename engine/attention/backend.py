"""Attention backend choice: which backend serves ("auto" | "torch" | "triton") on a device,
and the start-up probe that says whether Triton kernels can run there.

It stands above the metadata module (``engine.attention.metadata``) and both backends, which import
only the metadata, so the backends never import their chooser. The backends are imported when
chosen, not at import, so that ``torch`` serving never imports Triton.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.attention.metadata import AttentionBackend

logger = logging.getLogger("kvserve.engine")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Return the backend for ``name`` ("auto" | "torch" | "triton") on ``device``.

    "auto" picks triton on CUDA when ``probe_triton`` can compile and launch a kernel there;
    otherwise it logs a WARNING with the reason and uses torch. On a CPU "auto" is torch.
    An explicit "triton" raises ``ValueError`` with the reason when the probe fails (on a CPU
    Triton runs only under ``TRITON_INTERPRET=1``, as the tests do).
    """
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            reason = probe_triton(device)
            if reason is None:
                name = "triton"
            else:
                logger.warning("attention backend: Triton does not work on %s, so the torch "
                               "backend serves instead (slower). %s", device, reason)
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        reason = probe_triton(device)
        if reason is not None:
            raise ValueError(f"attention_backend 'triton' cannot run on {device}: {reason}")
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")


_TOOLCHAIN_HINT = ("Triton builds a small C launcher at run time: install a C compiler and the "
                   "Python headers (e.g. apt-get install gcc python3-dev, or set CC), and check "
                   "that the NVIDIA driver matches the torch/Triton build.")


def probe_triton(device: torch.device) -> str | None:
    """Whether Triton kernels can run on ``device``: None when a tiny kernel compiled,
    launched and computed the right result there, else the reason (one short paragraph for
    a log line or an error). The outcome is cached per device for the process.

    On a CPU, Triton kernels run only under ``TRITON_INTERPRET=1``; there the probe launches
    in the interpreter (cheap), and without it the probe reports that it cannot run.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        try:
            device = torch.device("cuda", torch.cuda.current_device())
        except Exception as exc:
            return f"CUDA is not usable: {_first_lines(exc)}"
    return _probe_triton_cached(device)


@functools.lru_cache(maxsize=16)
def _probe_triton_cached(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import
        return (f"the triton package does not import ({_first_lines(exc)}); "
                "pip install 'kvserve[triton]'")
    if device.type == "cpu" and not _triton_interpreting():
        return ("on a CPU, Triton kernels run only under TRITON_INTERPRET=1 (set before "
                "start-up; slow, meant for tests)")
    try:
        from kvserve_kernels.probe import run_probe

        run_probe(device)
    except Exception as exc:
        hint = "" if device.type == "cpu" else " " + _TOOLCHAIN_HINT
        return f"a probe kernel failed: {_first_lines(exc).rstrip('.')}.{hint}"
    return None


def _triton_interpreting() -> bool:
    # Triton fixes interpreted vs compiled per @jit function when it is defined, which for
    # kvserve's kernels is at import: ask the kernels, not the environment, when they exist.
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from kvserve_kernels.probe import _add_one_kernel
    except Exception:
        return False
    return isinstance(_add_one_kernel, InterpretedFunction)


def _first_lines(exc: BaseException, lines: int = 3, chars: int = 400) -> str:
    """``Type: message`` cut to its first non-empty lines: enough to name the cause in a log
    line without pasting a compiler's whole output."""
    text = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    msg = " | ".join(text[:lines])
    if len(text) > lines:
        msg += " | ..."
    if len(msg) > chars:
        msg = msg[:chars - 3] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
