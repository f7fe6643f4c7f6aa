"""RotaryEmbedding keeps half-width tables and widens the rows a step asks for: the values are
HF's rotate-half cos/sin (``cat(freqs, freqs)``, computed here independently from the inverse
frequencies), the memory half of full-width tables, positions past the table refused."""

from __future__ import annotations

import pytest
import torch

from engine.models.arch import RopeSpec
from engine.models.rope import RotaryEmbedding, inv_frequencies

SPECS = [RopeSpec(theta=10000.0), RopeSpec(theta=1e6),
         RopeSpec(theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=64)]


@pytest.mark.parametrize("spec", SPECS, ids=["base1e4", "base1e6", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_rows_are_the_full_width_rotate_half_tables(spec, head_dim):
    n = 300
    rot = RotaryEmbedding(spec, head_dim, n)
    assert rot.cos_half.shape == rot.sin_half.shape == (n, head_dim // 2)
    assert rot.max_positions == n
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_frequencies(spec, head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    positions = torch.tensor([0, 1, 17, 255, 299, 17])
    cos, sin = rot.rows(positions)
    assert cos.shape == sin.shape == (6, head_dim)
    torch.testing.assert_close(cos, emb.cos()[positions], rtol=0, atol=2e-7)
    torch.testing.assert_close(sin, emb.sin()[positions], rtol=0, atol=2e-7)
    # both halves are the same floats (HF's layout), and an int position gives one row
    assert torch.equal(cos[:, :head_dim // 2], cos[:, head_dim // 2:])
    c1, s1 = rot.rows(17)
    assert c1.shape == (head_dim,) and torch.equal(c1, cos[2]) and torch.equal(s1, sin[2])


def test_cos_sin_casts_and_checks_the_table_length():
    rot = RotaryEmbedding(RopeSpec(theta=10000.0), 32, 16)
    cos, sin = rot.cos_sin(torch.tensor([3, 15]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (2, 32)
    assert torch.equal(cos, rot.rows(torch.tensor([3, 15]))[0].bfloat16())
    with pytest.raises(ValueError, match="beyond the RoPE table"):
        rot.cos_sin(torch.tensor([16]), torch.float32)
    with pytest.raises(ValueError, match="beyond the RoPE table"):
        rot.cos_sin(torch.tensor([0]), torch.float32, max_position=16)
