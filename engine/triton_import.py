"""Keeping Triton out of a process that does not use it.

torch imports Triton on its own whenever ``torch._dynamo`` is first imported (its
``has_triton_package()``), and that happens on any meta-device computation (building the model
on the meta device runs torch's Python references, whose wrapper imports ``torch._dynamo``).
On a CPU-only server that import serves nothing, takes time, and Triton's nanobind extension
prints "leaked instances" warnings at every exit. :func:`import_torch_dynamo_without_triton`
imports ``torch._dynamo`` first with Triton hidden, so that torch records "no Triton" (it
caches the answer) and never imports it; kvserve's own Triton code (``kvserve_kernels/``, the Triton
attention backend) still imports it normally when it is chosen.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch


def triton_wanted(device: torch.device, attention_backend: str) -> bool:
    """Whether this engine may run Triton kernels: on a GPU, or on a CPU only when the Triton
    backend was asked for (it runs there under ``TRITON_INTERPRET=1``, as the tests do)."""
    return device.type != "cpu" or attention_backend == "triton"


def import_torch_dynamo_without_triton() -> bool:
    """Import ``torch._dynamo`` with ``import triton`` failing, unless Triton or
    ``torch._dynamo`` is imported already. True when it did so (torch then believes Triton is
    not installed, for the life of the process)."""
    if "triton" in sys.modules or "torch._dynamo" in sys.modules:
        return False
    with _triton_hidden():
        import torch._dynamo  # noqa: F401
    return True


class _HideTriton:
    """A ``sys.meta_path`` finder that makes ``import triton`` (and its submodules) fail."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: not used here)",
                                      name=name)
        return None


@contextlib.contextmanager
def _triton_hidden() -> Iterator[None]:
    finder = _HideTriton()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
