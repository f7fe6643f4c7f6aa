"""The host KV tier's memory: one flat buffer of the exact size, page-locked in place on CUDA.

Not ``torch.empty(shape, pin_memory=True)`` per layer: PyTorch's caching host allocator rounds
every pinned allocation up to a power of two. One buffer of exactly the needed bytes is
allocated as ordinary memory and page-locked with ``cudaHostRegister``, which pins the range it
is given (``torch.cuda.cudart().cudaHostRegister(ptr, size, flags)`` / ``cudaHostUnregister(ptr)``
return a ``cudaError``, 0 = success; the GIL is released during the call).

:func:`allocate_host_pools` gives per-layer (K, V) views into that buffer, each on a 256-byte
boundary, uninitialised; ``pin=True`` needs CUDA, and a failed registration leaves the buffer
usable, unpinned (``pinned`` says which). Unregistration happens once, when the memory is freed
or at ``close()``; process exit skips it. The full contract is on :func:`allocate_host_pools`."""

from __future__ import annotations

import logging
import math
import mmap
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger("kvserve.engine")

ALIGN = 256  # bytes; every view starts on such a boundary (>= any vector width a kernel uses)
_PAGE = mmap.PAGESIZE


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class HostPools:
    """Per-layer (K, V) host pools carved out of one flat buffer; see the module docstring."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    buffer: torch.Tensor  # uint8 [nbytes]; every view lies inside it
    nbytes: int
    pinned: bool
    _unregister: weakref.finalize | None = field(default=None, repr=False)

    def close(self) -> None:
        """Unregister the buffer now (once; later calls do nothing). The views stay valid as
        pageable memory; no copy using them may be in flight."""
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        self.pinned = False


def _unregister(cudart, ptr: int) -> None:
    rc = int(cudart.cudaHostUnregister(ptr))
    if rc != 0:
        logger.warning("cudaHostUnregister failed (cudaError %d)", rc)


def _clear_cuda_error() -> None:
    """A failed runtime call is also returned by the next ``cudaGetLastError``, which PyTorch
    checks after each kernel launch: consume it now so no unrelated kernel is blamed later."""
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:  # best effort: the failing launch check is what clears the error
        pass


def _register(array: np.ndarray, start: int, size: int) -> weakref.finalize | None:
    """Page-lock ``size`` bytes of ``array`` from ``start``; on success return the finalizer
    that unregisters them when ``array`` is freed (or when called)."""
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister"):  # not in any supported torch; be safe
        logger.warning("this torch exposes no cudaHostRegister: host KV tier not pinned "
                       "(host<->device copies will be slower)")
        return None
    ptr = array.ctypes.data + start
    rc = cudart.cudaHostRegister(ptr, size, 0)  # 0: cudaHostRegisterDefault (mapped under UVA)
    if int(rc) != 0:
        try:
            reason = cudart.cudaGetErrorString(rc)
        except Exception:  # the code alone is still worth logging
            reason = "?"
        _clear_cuda_error()
        logger.warning("cudaHostRegister of %.2f GiB failed (cudaError %d: %s): host KV tier "
                       "not pinned (host<->device copies will be slower)",
                       size / 2**30, int(rc), reason)
        return None
    fin = weakref.finalize(array, _unregister, cudart, ptr)
    fin.atexit = False
    return fin


def allocate_host_pools(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                        pin: bool) -> HostPools:
    """Allocate ``num_layers`` (K, V) pools of ``shape``/``dtype`` in one flat host buffer,
    page-locked when ``pin``. Contract:

    * ``layers[i] == (K_i, V_i)``: contiguous tensors of ``shape``/``dtype``, views into
      ``buffer`` (uint8, ``nbytes`` long). Each view starts on a 256-byte boundary; they do not
      overlap; ``nbytes`` is the sum of their sizes, each rounded up to 256 bytes. Contents are
      uninitialised (a host block is only read after a copy filled it).
    * ``pin=True`` needs CUDA (``ValueError`` otherwise: pinning is meaningless without a GPU
      and asking for it points at a wrong device choice). If registration fails (the driver's
      return code is not success), a warning is logged and the buffer stays usable, unpinned:
      ``pinned`` says which. ``tensor.is_pinned()`` is true for the views of a registered buffer.
    * Unregistration happens once: when the memory itself is freed (the last view is gone), or
      earlier by ``close()``; after ``close()`` the views still work, as pageable memory.
      Process exit skips it (the driver drops the registration with the process)."""
    if num_layers < 1 or not shape or min(shape) < 1:
        raise ValueError(f"host pools need >= 1 layer and a non-empty shape; got "
                         f"{num_layers} layers of {tuple(shape)}")
    if pin and not torch.cuda.is_available():
        raise ValueError("pinned host KV pools need a CUDA device, and torch sees none; "
                         "allocate them with pin=False on CPU")
    view_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    stride = _round_up(view_bytes, ALIGN)
    nbytes = stride * 2 * num_layers
    # numpy owns the memory so that its lifetime (the last view's) can trigger unregistration:
    # torch.from_numpy storages keep the array alive, and weakref callbacks run before numpy
    # frees the data. The start is page-aligned; the registered range is whole pages of ours.
    array = np.empty(nbytes + 2 * _PAGE, dtype=np.uint8)
    start = (-array.ctypes.data) % _PAGE
    buffer = torch.from_numpy(array)[start:start + nbytes]
    fin = _register(array, start, _round_up(nbytes, _PAGE)) if pin else None
    del array  # the views hold it from here on

    def view(i: int) -> torch.Tensor:
        return buffer[i * stride:i * stride + view_bytes].view(dtype).view(shape)

    layers = [(view(2 * i), view(2 * i + 1)) for i in range(num_layers)]
    return HostPools(layers=layers, buffer=buffer, nbytes=nbytes, pinned=fin is not None,
                     _unregister=fin)
