"""Triton multi-LoRA shrink/expand against the PyTorch references: mixed slots in one launch,
rows with slot -1 left exactly as they were, and the expand writing only its part's columns."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, TOLERANCE

pytest.importorskip("triton")
from kvserve_kernels import reference as ref  # noqa: E402
from kvserve_kernels.lora import lora_expand, lora_shrink  # noqa: E402

SLOTS, RANK, PARTS = 3, 8, 3


def _row_slots(rows: int, seed: int) -> torch.Tensor:
    """Slots -1 .. SLOTS-1 at random, with the first row -1 and the last slot 0 when there is
    room, so every mix below has base rows and adapter rows."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, SLOTS, (rows,), generator=g, dtype=torch.int32)
    if rows > 1:
        slots[0], slots[-1] = -1, 0
    return slots.to(DEVICE)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 24), (5, 40), (17, 24)])
def test_shrink_matches_reference(dtype, rows, k):
    x = _randn(rows, k, dtype=dtype, seed=1)
    a = _randn(SLOTS, PARTS * RANK, k, dtype=dtype, seed=2)
    slots = _row_slots(rows, seed=rows)
    y = lora_shrink(x, a, slots)
    expected = ref.lora_shrink_ref(x, a, slots)
    assert y.dtype == torch.float32 and y.shape == (rows, PARTS * RANK)
    # Both sum float32 products of the same inputs; only the order of the sum differs.
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[slots < 0], torch.zeros_like(y[slots < 0]))


def test_shrink_strided_inputs_and_all_base_rows():
    # x a column slice of a wider tensor, a a slice of a longer stack: strides, not copies.
    wide = _randn(6, 50, dtype=torch.float32, seed=3)
    x = wide[:, 5:45]
    a = _randn(SLOTS + 1, 20, 40, dtype=torch.float32, seed=4)[1:]
    slots = torch.tensor([2, -1, 0, 1, 2, -1], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(lora_shrink(x, a, slots), ref.lora_shrink_ref(x, a, slots),
                               rtol=1e-5, atol=1e-5)
    none = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(lora_shrink(x, a, none), torch.zeros(6, 20, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("part", range(PARTS))
def test_expand_matches_reference(dtype, rows, part):
    part_sizes = (24, 10, 10)  # fused QKV-like parts, none a power of two but the first
    m = part_sizes[part]
    out_offset = sum(part_sizes[:part])
    y = _randn(rows, PARTS * RANK, dtype=torch.float32, seed=5)
    b = _randn(SLOTS, m, RANK, dtype=dtype, seed=6)
    out = _randn(rows, sum(part_sizes), dtype=dtype, seed=7)
    slots = _row_slots(rows, seed=rows + 100)
    expected = out.clone()
    ref.lora_expand_ref(y, b, slots, expected, part * RANK, out_offset)
    lora_expand(y, b, slots, out, y_offset=part * RANK, out_offset=out_offset)
    tol = TOLERANCE[dtype]
    # bf16: a delta summed in another order may round to the neighbouring bf16 before the add.
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_expand_touches_only_its_rows_and_columns():
    rows, width, m, out_offset = 9, 40, 13, 11
    y = _randn(rows, PARTS * RANK, dtype=torch.float32, seed=8)
    b = _randn(SLOTS, m, RANK, dtype=torch.bfloat16, seed=9)
    slots = torch.tensor([-1, 0, 2, -1, 1, 1, -1, 2, 0], dtype=torch.int32, device=DEVICE)
    out = _randn(rows, width, dtype=torch.bfloat16, seed=10)
    before = out.clone()
    lora_expand(y, b, slots, out, y_offset=RANK, out_offset=out_offset)
    cols = torch.zeros(width, dtype=torch.bool, device=DEVICE)
    cols[out_offset:out_offset + m] = True
    base = slots < 0
    assert torch.equal(out[base], before[base])  # base-model rows: bit for bit
    assert torch.equal(out[:, ~cols], before[:, ~cols])  # other parts' columns: bit for bit
    assert not torch.equal(out[~base][:, cols], before[~base][:, cols])


def test_expand_into_strided_out_view():
    # out a column window of a wider buffer: the row stride is the buffer's, not out's width.
    buffer = _randn(5, 64, dtype=torch.float32, seed=11)
    out = buffer[:, 8:40]
    y = _randn(5, PARTS * RANK, dtype=torch.float32, seed=12)
    b = _randn(SLOTS, 20, RANK, dtype=torch.float32, seed=13)
    slots = torch.tensor([1, -1, 0, 2, 1], dtype=torch.int32, device=DEVICE)
    expected = buffer.clone()
    ref.lora_expand_ref(y, b, slots, expected[:, 8:40], 2 * RANK, 12)
    lora_expand(y, b, slots, out, y_offset=2 * RANK, out_offset=12)
    torch.testing.assert_close(buffer, expected, rtol=1e-5, atol=1e-5)


def test_shrink_then_expand_is_the_lora_delta():
    # The whole path of one fused projection: each part's delta lands in its own columns.
    rows, k, part_sizes = 7, 40, (16, 8, 8)
    x = _randn(rows, k, dtype=torch.float32, seed=14)
    a = _randn(SLOTS, PARTS * RANK, k, dtype=torch.float32, seed=15)
    bs = [_randn(SLOTS, size, RANK, dtype=torch.float32, seed=16 + i)
          for i, size in enumerate(part_sizes)]
    slots = torch.tensor([0, -1, 2, 1, 0, -1, 2], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(rows, sum(part_sizes), device=DEVICE)
    y = lora_shrink(x, a, slots)
    for part, b in enumerate(bs):
        lora_expand(y, b, slots, out, y_offset=part * RANK,
                    out_offset=sum(part_sizes[:part]))
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[t], torch.zeros_like(out[t]))
            continue
        parts = [x[t] @ a[slot, p * RANK:(p + 1) * RANK].t() @ bs[p][slot].t()
                 for p in range(PARTS)]
        torch.testing.assert_close(out[t], torch.cat(parts), rtol=1e-4, atol=1e-4)


def test_empty_batch_and_bad_shapes():
    x = torch.zeros(0, 24, device=DEVICE)
    a = torch.zeros(SLOTS, 8, 24, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert lora_shrink(x, a, none).shape == (0, 8)
    lora_expand(torch.zeros(0, 8, device=DEVICE), torch.zeros(SLOTS, 4, 8, device=DEVICE), none,
                torch.zeros(0, 4, device=DEVICE), y_offset=0, out_offset=0)
    slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="must match"):
        lora_shrink(torch.zeros(2, 24, device=DEVICE), a.half(), slots)
    with pytest.raises(ValueError, match="outside out"):
        lora_expand(torch.zeros(2, 8, device=DEVICE), torch.zeros(SLOTS, 4, 8, device=DEVICE),
                    slots, torch.zeros(2, 6, device=DEVICE), y_offset=0, out_offset=3)
