"""One step's block moves between the device KV pools and the host tier, off the compute path.

``HostTierCopier(device_pools, host_pools, device).copy(d2h, h2d)``: ``d2h`` are (device block,
host block) pairs (write-backs, swap-outs), ``h2d`` (host block, device block) pairs (load-backs,
swap-ins). Semantics are those of ``copy_blocks`` on every layer's K and V, d2h before h2d. On
CUDA (staged mode) the host never waits for the device inside ``copy``: the moves run on a side
stream through pinned staging buffers, the compute stream waits on an event that covers the
d2h gather and the h2d, and the scatter into the host pools is left pending (the ordering is
spelled out on :class:`HostTierCopier`). On CPU ``copy`` runs ``copy_blocks`` synchronously.

``wait_d2h()`` lands the pending write-backs: only after it do the host pools hold the last
call's d2h blocks and may the host overwrite them; ``copy`` calls it first, call it yourself
before reading host pools on the CPU. Host pools need not be pinned. Block ids must be in range
and each call's destinations distinct (``copy_blocks``'s contract); ``ValueError`` otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from engine.kv_format.formats import byte_view

KVPools = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def _check_ids(ids: list[int], n: int, what: str, distinct: bool) -> None:
    if ids and (min(ids) < 0 or max(ids) >= n):
        raise ValueError(f"{what} block ids must lie in [0, {n}); got {sorted(set(ids))}")
    if distinct and len(set(ids)) != len(ids):
        raise ValueError(f"{what} destination blocks must be distinct in one call; got {ids}")


class HostTierCopier:
    """Moves KV blocks between ``device_pools`` and ``host_pools`` (lists of per-layer (K, V)
    of one block shape and dtype). ``copy`` in staged mode (CUDA), in order:

    1. a side stream waits for the compute stream (the blocks it reads were written by queued
       work);
    2. d2h: the blocks are gathered per layer (``index_select``) into one device staging tensor
       ``[2 * layers, N, *block]``;
    3. h2d: the host blocks are gathered on the CPU into a pinned staging tensor, moved with one
       non-blocking transfer and scattered per layer (``index_copy_``) into the device pools;
    4. event ``ready``; the compute stream waits on it. It covers the d2h *gather* as well as
       the h2d: the device blocks just written back are free again and this step may overwrite
       them;
    5. d2h: one non-blocking transfer of the staging tensor into a pinned host staging buffer;
       event ``done``. The scatter into the host pools is left pending until ``wait_d2h``.

    Not ``kvserve_kernels.copy_blocks`` on CUDA: its Triton path builds its mapping and offset
    tensors from pageable memory, each of which synchronizes the stream; index tensors here
    travel non-blocking from pinned memory, at 2 launches per layer. An h2d that reads a host
    block written by a d2h of the *same* call lands that write-back first. Every transfer goes
    through this class's pinned staging buffers (grown to a power of two as needed, then kept:
    up to twice the largest step's moves per direction).

    ``staged`` defaults to ``device.type == "cuda"``; tests force it on CPU to run the staged
    bookkeeping (without streams) against the synchronous truth."""

    def __init__(self, device_pools: KVPools, host_pools: KVPools, device: torch.device | str,
                 staged: bool | None = None) -> None:
        from kvserve_kernels.copy_blocks import copy_blocks  # here: it pulls in triton

        self._copy_blocks = copy_blocks
        # fp8 pools move as bytes (CPU PyTorch has no float8 index_select / index_copy_).
        self._dev = [byte_view(t) for kv in device_pools for t in kv]
        self._host = [byte_view(t) for kv in host_pools for t in kv]
        if len(self._dev) != len(self._host) or not self._dev:
            raise ValueError(f"{len(self._dev) // 2} device layers but {len(self._host) // 2} "
                             f"host layers")
        for d, h in zip(self._dev, self._host):
            if d.shape[1:] != h.shape[1:] or d.dtype != h.dtype or h.device.type != "cpu":
                raise ValueError(f"host pools must be CPU tensors with the device pools' block "
                                 f"shape and dtype; got {tuple(h.shape)} {h.dtype} on "
                                 f"{h.device} for {tuple(d.shape)} {d.dtype}")
        self.device = torch.device(device)
        self._staged = self.device.type == "cuda" if staged is None else staged
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._done: torch.cuda.Event | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (staged, host ids)
        self._buffers: dict[str, torch.Tensor] = {}

    # ---- the contract ------------------------------------------------------------------

    def copy(self, d2h: list[tuple[int, int]], h2d: list[tuple[int, int]]) -> None:
        """This step's moves, d2h before h2d (see the class docstring). On return the compute
        stream is ordered after every device-side read and write of this call."""
        self.wait_d2h()
        n_dev, n_host = self._dev[0].shape[0], self._host[0].shape[0]
        _check_ids([d for d, _ in d2h], n_dev, "device", distinct=False)
        _check_ids([h for _, h in d2h], n_host, "host", distinct=True)
        _check_ids([h for h, _ in h2d], n_host, "host", distinct=False)
        _check_ids([d for _, d in h2d], n_dev, "device", distinct=True)
        if not d2h and not h2d:
            return
        if not self._staged:
            if d2h:
                self._copy_blocks(self._dev, self._host, _pairs(d2h))
            if h2d:
                self._copy_blocks(self._host, self._dev, _pairs(h2d))
            return
        compute = torch.cuda.current_stream(self.device) if self._cuda else None
        with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
            if compute is not None:
                self._stream.wait_stream(compute)
            gathered = self._gather_on_device([d for d, _ in d2h]) if d2h else None
            host_ids = torch.tensor([h for _, h in d2h], dtype=torch.int64)
            if gathered is not None and not {h for h, _ in h2d}.isdisjoint(h for _, h in d2h):
                self._write_back(gathered, host_ids)  # the h2d below reads these blocks
                gathered = None
                self._record_done()
                self.wait_d2h()
            if h2d:
                self._load(h2d)
            ready = self._record()
            if gathered is not None:
                self._write_back(gathered, host_ids)
            self._record_done()
        if ready is not None:
            compute.wait_event(ready)

    def wait_d2h(self) -> None:
        """Block until the last call's transfers have finished, then scatter its write-backs
        into the host pools. Afterwards the host pools hold every block written back so far."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        if self._pending is not None:
            staged, host_ids = self._pending
            self._pending = None
            for i, h in enumerate(self._host):
                h.index_copy_(0, host_ids, staged[i])

    # ---- the steps -----------------------------------------------------------------------

    def _index(self, ids: list[int]) -> torch.Tensor:
        """``ids`` as an int64 tensor on the device, without a host sync: ``torch.tensor(...,
        device=cuda)`` or ``.to(cuda)`` from pageable memory synchronizes the stream."""
        t = torch.tensor(ids, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self._cuda else t

    def _gather_on_device(self, dev_ids: list[int]) -> torch.Tensor:
        idx = self._index(dev_ids)
        out = torch.empty((len(self._dev), len(dev_ids), *self._dev[0].shape[1:]),
                          dtype=self._dev[0].dtype, device=self.device)
        for i, pool in enumerate(self._dev):
            torch.index_select(pool, 0, idx, out=out[i])
        return out

    def _write_back(self, gathered: torch.Tensor, host_ids: torch.Tensor) -> None:
        staged = self._host_staging("d2h", gathered.shape)
        staged.copy_(gathered, non_blocking=self._cuda)
        self._pending = (staged, host_ids)

    def _load(self, h2d: list[tuple[int, int]]) -> None:
        staged = self._host_staging("h2d", (len(self._host), len(h2d), *self._host[0].shape[1:]))
        host_ids = torch.tensor([h for h, _ in h2d], dtype=torch.int64)
        for i, h in enumerate(self._host):
            torch.index_select(h, 0, host_ids, out=staged[i])
        on_device = staged.to(self.device, non_blocking=self._cuda)
        idx = self._index([d for _, d in h2d])
        for i, pool in enumerate(self._dev):
            pool.index_copy_(0, idx, on_device[i])

    def _host_staging(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A reusable host buffer (pinned on CUDA) viewed as ``shape``; safe to overwrite
        because ``copy`` waited for the transfers of the previous call first."""
        dtype = self._host[0].dtype
        nbytes = torch.Size(shape).numel() * self._host[0].element_size()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            size = 1 << max(nbytes - 1, 1).bit_length()  # the caching host allocator rounds so
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).view(*shape)

    def _record(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _record_done(self) -> None:
        self._done = self._record()
