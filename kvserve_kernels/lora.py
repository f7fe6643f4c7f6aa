"""Triton kernels for batched multi-LoRA (punica's "bgmv" shape): every row of a step under its
own adapter slot, in one launch per call however many slots the batch mixes.

The adapters sit stacked over slots (engine/lora/weights.py, the GPU layout): ``A [S, N, K]``
for a projection (its fused parts' A matrices one after another along ``N``, zero-padded to
the maximum rank) and per fused part ``B [S, M, R]``. A projection's delta is

* :func:`lora_shrink`: ``y[t] = x[t] @ A[slot(t)].T``, float32 ``[T, N]``, then
* :func:`lora_expand` once per part: ``out[t, part cols] += y[t, part rank cols] @ B[slot(t)].T``.

Each program owns one row and one tile of output columns, reads the row's slot and gathers
that slot's weights: a matrix-vector product per row, summed in float32 from products of
float32-cast operands (``tl.sum``, not ``tl.dot``: the row is a vector, and a rank needs no
padding to 16). Rows whose slot is -1 run the base model: their loops run zero times and the
expand stores nothing. Nothing is split per slot and no integer argument varies per step
(the row count only sizes the grid), so the launches can be captured in a CUDA graph.

Made for decode-sized batches (tens to hundreds of rows); a long prefill re-reads each slot's
A and B once per row, which a segmented (sgmv-style) kernel would avoid.

Every tensor is passed with all its strides: views are fine, nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles: the shrink's N (a few ranks) is small and K (the hidden size) long; the expand's M
# (a projection part's width) is long and R (one rank) small. Powers of two, masked at edges.
_SHRINK_BLOCK_N = 16
_SHRINK_BLOCK_K = 128
_EXPAND_BLOCK_M = 64
_EXPAND_MAX_BLOCK_R = 64


# The slot tensor is read one scalar per program: a slice of it at any offset must not make a
# new variant.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, y_ptr,
    N, K,
    stride_xt, stride_xk,
    stride_as, stride_an, stride_ak,
    stride_yt, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot -1: no adapter. The loop runs zero times and the row's tile is stored as zeros.
    k_end = tl.where(slot >= 0, K, 0)
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + n[:, None] * stride_an  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k_mask, other=0.0)
        av = tl.load(a_rows + k[None, :] * stride_ak, mask=n_mask[:, None] & k_mask[None, :],
                     other=0.0)
        acc += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + t * stride_yt + n * stride_yn, acc, mask=n_mask)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _lora_expand_kernel(
    y_ptr, b_ptr, slot_ptr, out_ptr,
    M, R, y_offset, out_offset,
    stride_yt, stride_yr,
    stride_bs, stride_bm, stride_br,
    stride_ot, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot -1: no adapter. No column is in range: the loop runs zero times, nothing is stored.
    m_end = tl.where(slot >= 0, M, 0)
    m_mask = m < m_end
    r_end = tl.where(slot >= 0, R, 0)
    b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + m[:, None] * stride_bm  # [BLOCK_M, 1]
    y_row = y_ptr + t * stride_yt + y_offset * stride_yr
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r0 in range(0, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < R
        yv = tl.load(y_row + r * stride_yr, mask=r_mask, other=0.0)
        bv = tl.load(b_rows + r[None, :] * stride_br, mask=m_mask[:, None] & r_mask[None, :],
                     other=0.0)
        acc += tl.sum(bv.to(tl.float32) * yv.to(tl.float32)[None, :], axis=1)
    out_ptrs = out_ptr + t * stride_ot + (out_offset + m) * stride_om
    cur = tl.load(out_ptrs, mask=m_mask, other=0.0)
    # As PyTorch's ``out += delta.to(out.dtype)``: the delta rounded to out's dtype, then added.
    delta = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptrs, (cur.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=m_mask)


def _check_slots(row_slots: torch.Tensor, rows: int) -> None:
    if row_slots.dim() != 1 or row_slots.shape[0] != rows:
        raise ValueError(f"row_slots must be [T] = [{rows}]; got {tuple(row_slots.shape)}")
    if row_slots.dtype.is_floating_point or row_slots.dtype == torch.bool:
        raise ValueError(f"row_slots must hold integers; got {row_slots.dtype}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] @ a[row_slots[t]].T`` for every row, 0 for rows whose slot is -1.

    ``x`` ``[T, K]`` (float16, bfloat16 or float32), ``a`` ``[S, N, K]`` in ``x``'s dtype (the
    slots' stacked A), ``row_slots`` ``[T]`` integers (int32 from the batch), each -1 or a slot
    in ``0 .. S-1`` (not checked: reading it would synchronise with the device). Returns a new
    float32 ``[T, N]``, summed in float32. Any strides.
    """
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [T, K] and a [S, N, K]; got {tuple(x.shape)} and "
                         f"{tuple(a.shape)}")
    if a.dtype != x.dtype:
        raise ValueError(f"a is {a.dtype}, x is {x.dtype}: they must match")
    rows, k = x.shape
    n = a.shape[1]
    _check_slots(row_slots, rows)
    y = torch.empty(rows, n, device=x.device, dtype=torch.float32)
    if rows == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    grid = (rows, triton.cdiv(n, _SHRINK_BLOCK_N))
    _lora_shrink_kernel[grid](
        x, a, row_slots, y,
        n, k,
        x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_N=_SHRINK_BLOCK_N,
        BLOCK_K=min(_SHRINK_BLOCK_K, triton.next_power_of_2(k)),
    )
    return y


def lora_expand(y: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, out: torch.Tensor,
                *, y_offset: int, out_offset: int) -> None:
    """``out[t, out_offset:out_offset+M] += (y[t, y_offset:y_offset+R] @ b[row_slots[t]].T)``
    cast to ``out``'s dtype, in place, for every row whose slot is not -1; rows with slot -1
    and every other column of ``out`` are left as they are.

    ``y`` ``[T, N]`` float32 (from :func:`lora_shrink`), ``b`` ``[S, M, R]`` (one fused part's
    B, the model's dtype), ``out`` ``[T, O]`` (a projection's output, the model's dtype),
    ``row_slots`` as for :func:`lora_shrink`. The product is summed in float32, rounded to
    ``out``'s dtype, then added, as PyTorch's ``out += delta.to(out.dtype)`` does. Any strides.
    """
    if y.dim() != 2 or b.dim() != 3 or out.dim() != 2:
        raise ValueError(f"y must be [T, N], b [S, M, R] and out [T, O]; got {tuple(y.shape)}, "
                         f"{tuple(b.shape)} and {tuple(out.shape)}")
    rows = y.shape[0]
    _, m, r = b.shape
    if out.shape[0] != rows:
        raise ValueError(f"out has {out.shape[0]} rows, y {rows}")
    if not (0 <= y_offset and y_offset + r <= y.shape[1]):
        raise ValueError(f"y columns {y_offset}..{y_offset + r} are outside y's {y.shape[1]}")
    if not (0 <= out_offset and out_offset + m <= out.shape[1]):
        raise ValueError(f"out columns {out_offset}..{out_offset + m} are outside out's "
                         f"{out.shape[1]}")
    _check_slots(row_slots, rows)
    if rows == 0 or m == 0 or r == 0:
        return
    grid = (rows, triton.cdiv(m, _EXPAND_BLOCK_M))
    _lora_expand_kernel[grid](
        y, b, row_slots, out,
        m, r, y_offset, out_offset,
        y.stride(0), y.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=_EXPAND_BLOCK_M,
        BLOCK_R=min(_EXPAND_MAX_BLOCK_R, triton.next_power_of_2(r)),
    )
