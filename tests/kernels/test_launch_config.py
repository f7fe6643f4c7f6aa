"""Launch choices per kernel (kvserve_kernels/launch_config.py): today's defaults, the environment
overrides a GPU sweep uses, and their validation. Plain arithmetic: no kernel runs here."""

from __future__ import annotations

import pytest
import torch

from kvserve_kernels import launch_config as lc

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(lc.DECODE_ENV, raising=False)
    monkeypatch.delenv(lc.PREFILL_ENV, raising=False)
    lc.clear_launch_config_cache()
    yield
    lc.clear_launch_config_cache()


def test_defaults_are_the_tuned_values():
    for head_dim in (64, 80, 128):
        cfg = lc.decode_launch_config(head_dim, BF16, True)
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm) == (64, 4, 2, 4)
    assert lc.decode_launch_config(256, BF16, True).block_n == 32
    assert lc.decode_launch_config(128, BF16, False).block_n == 32  # the interpreter
    # Prefill: BLOCK_M by rows (query tokens x GQA group), warps by tile size.
    expect = {(128, 8): (16, 64, 4), (128, 32): (32, 64, 4), (128, 33): (64, 64, 8),
              (64, 500): (64, 64, 4), (256, 500): (32, 32, 8), (80, 20): (32, 64, 4)}
    for (head_dim, rows), (block_m, block_n, warps) in expect.items():
        cfg = lc.prefill_launch_config(head_dim, BF16, True, rows)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == \
            (block_m, block_n, warps, 2), (head_dim, rows)
    assert lc.prefill_launch_config(64, BF16, False, 40).block_n == 32


def test_parse_accepts_a_full_or_partial_override():
    fields = ("block_n", "num_warps", "num_stages", "programs_per_sm")
    text = "BLOCK_N=32,num_warps=4,num_stages=2,programs_per_sm=4"
    assert lc.parse_launch_override(text, fields, "X") == {
        "block_n": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 4}
    assert lc.parse_launch_override(" num_warps = 8 , ", fields, "X") == {"num_warps": 8}
    assert lc.parse_launch_override("", fields, "X") == {}


@pytest.mark.parametrize("text,match", [
    ("BLOCK_M=32", "cannot read 'BLOCK_M=32'.*block_n, num_warps"),  # a prefill key
    ("num_warps", "cannot read"),
    ("num_warps=4,num_warps=8", "given twice"),
    ("num_warps=four", "'four' is not an integer"),
    ("num_warps=3", "power of two"),
    ("BLOCK_N=8", r"block_n=8 must be a power of two in \[16, 256\]"),
    ("num_stages=0", r"num_stages=0 must be in \[1, 8\]"),
    ("programs_per_sm=-1", "programs_per_sm=-1"),
])
def test_parse_rejects_bad_overrides_clearly(text, match):
    fields = ("block_n", "num_warps", "num_stages", "programs_per_sm")
    with pytest.raises(ValueError, match=match) as info:
        lc.parse_launch_override(text, fields, lc.DECODE_ENV)
    assert str(info.value).startswith(lc.DECODE_ENV)


def test_environment_overrides_apply_to_every_head_dim(monkeypatch):
    monkeypatch.setenv(lc.DECODE_ENV, "BLOCK_N=32,num_warps=8,programs_per_sm=2")
    monkeypatch.setenv(lc.PREFILL_ENV, "BLOCK_M=16,num_stages=3")
    lc.clear_launch_config_cache()
    for head_dim in (64, 128):
        cfg = lc.decode_launch_config(head_dim, BF16, True)
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm) == (32, 8, 2, 2)
        pre = lc.prefill_launch_config(head_dim, BF16, True, 1000)
        assert (pre.block_m, pre.block_n, pre.num_warps, pre.num_stages) == (16, 64, 4, 3)


def test_environment_is_read_once(monkeypatch):
    assert lc.decode_launch_config(128, BF16, True).num_warps == 4
    monkeypatch.setenv(lc.DECODE_ENV, "num_warps=8")
    assert lc.decode_launch_config(64, BF16, True).num_warps == 4  # parsed at first use
    lc.clear_launch_config_cache()
    assert lc.decode_launch_config(64, BF16, True).num_warps == 8


def test_a_malformed_environment_value_fails_at_first_use(monkeypatch):
    monkeypatch.setenv(lc.PREFILL_ENV, "BLOCK_M=24")
    with pytest.raises(ValueError, match="KVSERVE_PREFILL_CONFIG: block_m=24"):
        lc.prefill_launch_config(128, BF16, True, 16)


def test_choose_num_splits_follows_programs_per_sm(monkeypatch):
    pytest.importorskip("triton")
    from kvserve_kernels.paged_decode import choose_num_splits

    cpu = torch.device("cpu")  # 8 nominal SMs
    # 8 programs fill 4 x 8 = 32 slots after 4 splits; with 1 program per SM, after 1.
    assert choose_num_splits(1, 8, 32768, cpu) == 4
    monkeypatch.setenv(lc.DECODE_ENV, "programs_per_sm=1")
    lc.clear_launch_config_cache()
    assert choose_num_splits(1, 8, 32768, cpu) == 1
