"""Batched KV block moves: copy-on-write inside a pool, swap/offload between device and host.

``copy_blocks(src, dst, mapping)`` copies block ``mapping[i, 0]`` of every source pool into
block ``mapping[i, 1]`` of the matching destination pool: on one CUDA device one Triton launch
for all layers; on one non-CUDA device ``index_select`` + ``index_copy_`` per layer; across
devices a per-layer gather into one staging tensor, one transfer, a scatter (host->device
``non_blocking`` from a pinned host pool, the staging buffer kept alive by PyTorch's caching
host allocator; device->host waits before scattering).

Contract: destination blocks are distinct, and when source and destination are the same pool
no block is both a source and a destination in one call (the Triton path runs pairs in
parallel). Pools of one call share dtype and per-block shape; their block counts may differ."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve_kernels.kv_quant_layout import byte_view

try:  # Triton is optional: the host-offload tier must work on CPU-only installs too.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

_COPY_BLOCK = 1024

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(src_base, dst_base, src_offs, dst_offs, mapping_ptr, block_numel,
                            ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # grid: (pair, layer, chunk of the block). Elements move as same-width integers, so
        # the copy is bit-exact for any dtype. Layer l's pool starts ``src_offs[l]`` elements
        # from ``src_base`` (the first pool): unlike a loaded pointer, a base pointer plus an
        # offset hinted as a multiple of 16 lets the compiler emit 16-byte vector accesses.
        pair = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1)
        chunk = tl.program_id(2)
        src_blk = tl.load(mapping_ptr + pair * 2)
        dst_blk = tl.load(mapping_ptr + pair * 2 + 1)
        s_off = tl.load(src_offs + layer)
        d_off = tl.load(dst_offs + layer)
        if ALIGNED:
            s_off = tl.multiple_of(s_off, 16)
            d_off = tl.multiple_of(d_off, 16)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < block_numel
        x = tl.load(src_base + s_off + src_blk * block_numel + offs, mask=mask)
        tl.store(dst_base + d_off + dst_blk * block_numel + offs, x, mask=mask)


def _as_list(pools: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [pools] if isinstance(pools, torch.Tensor) else list(pools)


def _validate(srcs: list[torch.Tensor], dsts: list[torch.Tensor], mapping: torch.Tensor) -> None:
    if len(srcs) != len(dsts):
        raise ValueError(f"{len(srcs)} source pools but {len(dsts)} destination pools")
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise ValueError(f"mapping must be [N, 2] (src_block, dst_block); got "
                         f"{tuple(mapping.shape)}")
    if mapping.dtype != torch.int64:
        raise ValueError(f"mapping must be int64; got {mapping.dtype}")
    for s, d in zip(srcs, dsts, strict=True):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise ValueError(f"pool mismatch: src {tuple(s.shape)} {s.dtype} vs dst "
                             f"{tuple(d.shape)} {d.dtype}; blocks must have one shape and dtype")
        if s.device != srcs[0].device or d.device != dsts[0].device:
            raise ValueError("all source pools must share one device, and all destinations")
    if mapping.device.type == "cpu" and mapping.numel():
        # Cheap here (no device sync) and it turns silent memory corruption into an error.
        lo = int(mapping.min())
        hi_src, hi_dst = int(mapping[:, 0].max()), int(mapping[:, 1].max())
        if lo < 0 or hi_src >= srcs[0].shape[0] or hi_dst >= dsts[0].shape[0]:
            raise ValueError(f"mapping has block ids outside [0, {srcs[0].shape[0]}) / "
                             f"[0, {dsts[0].shape[0]})")


def copy_blocks_triton(srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                       mapping: torch.Tensor) -> None:
    """Same-device copy of all layers in one launch; pools must be contiguous. Exposed for
    tests, which run it on CPU tensors under the Triton interpreter."""
    device = srcs[0].device
    esize = srcs[0].element_size()
    as_int = _INT_OF_SIZE[esize]
    block_numel = srcs[0][0].numel()

    def bases_and_offsets(pools: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        first = pools[0].data_ptr()
        return pools[0].view(-1).view(as_int), [(t.data_ptr() - first) // esize for t in pools]

    src_base, src_offs = bases_and_offsets(srcs)
    dst_base, dst_offs = bases_and_offsets(dsts)
    aligned = all(o % 16 == 0 for o in src_offs + dst_offs)
    mapping = mapping.to(device).contiguous()
    grid = (mapping.shape[0], len(srcs), triton.cdiv(block_numel, _COPY_BLOCK))
    _copy_blocks_kernel[grid](
        src_base, dst_base, torch.tensor(src_offs, dtype=torch.int64, device=device),
        torch.tensor(dst_offs, dtype=torch.int64, device=device), mapping, block_numel,
        ALIGNED=aligned, BLOCK=_COPY_BLOCK)


def _copy_same_device(srcs, dsts, mapping) -> None:
    if (triton is not None and srcs[0].is_cuda and srcs[0].element_size() in _INT_OF_SIZE
            and all(t.is_contiguous() for t in srcs + dsts)):
        copy_blocks_triton(srcs, dsts, mapping)
        return
    mapping = mapping.to(srcs[0].device)
    src_idx, dst_idx = mapping[:, 0], mapping[:, 1]
    for s, d in zip(srcs, dsts, strict=True):
        d.index_copy_(0, dst_idx, s.index_select(0, src_idx))


def _copy_across_devices(srcs, dsts, mapping) -> None:
    src_dev, dst_dev = srcs[0].device, dsts[0].device
    n = mapping.shape[0]
    block_shape = srcs[0].shape[1:]
    host_src = src_dev.type == "cpu"
    pin_src = host_src and srcs[0].is_pinned()
    staged = torch.empty((len(srcs), n, *block_shape), dtype=srcs[0].dtype, device=src_dev,
                         pin_memory=pin_src)
    src_idx = mapping[:, 0].to(src_dev)
    for i, s in enumerate(srcs):
        torch.index_select(s, 0, src_idx, out=staged[i])
    if dst_dev.type == "cpu" and dsts[0].is_pinned() and src_dev.type == "cuda":
        moved = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        moved.copy_(staged, non_blocking=True)
        torch.cuda.current_stream(src_dev).synchronize()  # the CPU scatter reads it next
    else:
        moved = staged.to(dst_dev, non_blocking=pin_src)
    dst_idx = mapping[:, 1].to(dst_dev)
    for i, d in enumerate(dsts):
        d.index_copy_(0, dst_idx, moved[i])


def copy_blocks(src: torch.Tensor | Sequence[torch.Tensor],
                dst: torch.Tensor | Sequence[torch.Tensor], mapping: torch.Tensor) -> None:
    """Copy block ``mapping[i, 0]`` of each ``src`` pool into block ``mapping[i, 1]`` of the
    matching ``dst`` pool, in place. ``src``/``dst``: one pool ``[num_blocks, ...]`` or a list of
    per-layer pools; ``mapping``: int64 ``[N, 2]``. See the module docstring for the contract.
    """
    srcs, dsts = _as_list(src), _as_list(dst)
    _validate(srcs, dsts, mapping)
    # fp8 pools move as bytes: CPU PyTorch has no float8 index_select / index_copy_.
    srcs, dsts = [byte_view(t) for t in srcs], [byte_view(t) for t in dsts]
    if not srcs or mapping.shape[0] == 0:
        return
    if srcs[0].device == dsts[0].device:
        _copy_same_device(srcs, dsts, mapping)
    else:
        _copy_across_devices(srcs, dsts, mapping)
