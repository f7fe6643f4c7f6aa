"""The int4 KV row format (engine/kv_format/formats.py): layout, rounding, the rotation, bytes."""

from __future__ import annotations

import pytest
import torch

from engine.kv_format.formats import (
    dequantize_int4_plain,
    dequantize_rows,
    format_of,
    int4_group,
    int4_rotate,
    kv_format,
    quantize_rows,
)
from loadgen.kv_calc import PRESETS, kv_bytes_per_token


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_rotation_is_the_groupwise_hadamard_and_its_own_inverse(head_dim):
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    blocks = torch.block_diag(*[_sylvester(32)] * (head_dim // 32))
    torch.testing.assert_close(int4_rotate(x).double(), x.double() @ blocks, rtol=0, atol=1e-6)
    torch.testing.assert_close(int4_rotate(int4_rotate(x)), x, rtol=0, atol=1e-5)


def test_groups_of_32_else_the_whole_row_unrotated():
    assert int4_group(64) == 32 and int4_group(24) == 24 and int4_group(48) == 48
    x = torch.randn(2, 24)
    assert torch.equal(int4_rotate(x), x)  # a group of 24 is no power of two
    with pytest.raises(ValueError, match="even head_dim"):
        kv_format("int4", torch.float32, 63)


def test_layout_nibbles_in_q4_0_order_then_one_float16_scale_per_group():
    """Row bytes: per group of 32, byte i = element i (low nibble) | element i + 16 (high);
    then the groups' float16 scales. A group whose largest-magnitude value is -8 * s maps it
    to q = 0 exactly, with scale s."""
    d = 64
    fmt = kv_format("int4", torch.float32, d)
    assert fmt.row_width == d // 2 + 2 * 2 and fmt.storage_dtype == torch.uint8
    q = torch.arange(d) % 16  # nibbles 0..15 in order, twice per group
    y = (q.float() - 8) * 0.5  # group scale 0.5: its largest magnitude is -4 (q = 0)
    rows = quantize_rows(int4_rotate(y.view(1, 1, d)), fmt)[0, 0]
    for g in range(2):
        for i in range(16):
            byte = int(rows[g * 16 + i])
            assert byte & 15 == int(q[g * 32 + i]) and byte >> 4 == int(q[g * 32 + i + 16])
    assert rows[32:].view(torch.float16).tolist() == [0.5, 0.5]
    torch.testing.assert_close(dequantize_int4_plain(rows, d), y)


@pytest.mark.parametrize("head_dim", [64, 24])
def test_round_trip_error_is_half_a_step_of_the_rotated_row(head_dim):
    """Half a step everywhere but at the opposite extreme of a group's largest-magnitude
    value m (q4_0's levels are -8..7 steps of m/-8, so a value near -m is clipped to 7)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(50, 3, head_dim, generator=gen) * 4
    fmt = kv_format("int4", torch.float32, head_dim)
    rows = quantize_rows(x, fmt)
    g = int4_group(head_dim)
    y = int4_rotate(x).reshape(50, 3, -1, g)
    m = y.gather(-1, y.abs().argmax(-1, keepdim=True))
    t = y / (m / -8)  # each value in steps, -8 at m itself
    err = (dequantize_int4_plain(rows, head_dim).reshape(y.shape) - y).abs() / (m.abs() / 8)
    assert (err <= torch.clamp(t - 7, min=0.5) + 1e-2).all()
    # Rotated back, the error keeps its size (the rotation is orthonormal).
    back = dequantize_rows(rows, fmt, torch.float32)
    plain_err = dequantize_int4_plain(rows, head_dim).reshape(y.shape) - y
    torch.testing.assert_close((back - x).norm(), plain_err.norm(), rtol=1e-4, atol=1e-4)
    assert format_of(rows, head_dim) == fmt


def test_zero_rows_stay_zero_and_the_rotation_pays_for_an_outlier():
    fmt = kv_format("int4", torch.float32, 64)
    zero = torch.zeros(2, 1, 64)
    assert torch.equal(dequantize_rows(quantize_rows(zero, fmt), fmt, torch.float32), zero)
    # One channel 30x the others (as keys' outlier channels are): without the rotation every
    # other value of its group rounds to 0; with it the error is far smaller.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 1, 64, generator=gen)
    x[..., 5] *= 30
    rotated = (dequantize_rows(quantize_rows(x, fmt), fmt, torch.float32) - x).norm()
    plain_rows = quantize_rows(int4_rotate(x), fmt)  # quantises x itself: int4_rotate undone
    plain = (dequantize_int4_plain(plain_rows, 64) - x).norm()
    assert rotated < 0.6 * plain


@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-3-8b", "qwen2.5-0.5b"])
def test_bytes_per_token_under_0_3_of_16_bit_and_kv_calc_agrees(preset):
    shape = PRESETS[preset]
    fmt = kv_format("int4", torch.float32, shape.head_dim)
    per_token = 2 * shape.layers * shape.kv_heads * fmt.row_bytes
    assert per_token == kv_bytes_per_token(shape, "int4")
    assert per_token <= 0.3 * kv_bytes_per_token(shape, "float16")
