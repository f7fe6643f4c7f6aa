"""Launch choices of the attention kernels (tile sizes, warps, pipeline stages, occupancy),
one function per kernel, so that they can differ by head_dim and dtype and be swept on a GPU
without code edits.

The defaults are one estimate from the sm_90 build at head_dim 128 (see benchmarks/attention_kernels.py
to measure others). A benchmark overrides them through the environment, read once per process:

    KVSERVE_DECODE_CONFIG="BLOCK_N=32,num_warps=4,num_stages=2,programs_per_sm=4"
    KVSERVE_PREFILL_CONFIG="BLOCK_M=32,BLOCK_N=64,num_warps=4,num_stages=2"

Any subset of a kernel's keys may be given; the rest keep their defaults. An override applies
to every head_dim and dtype of the process (a sweep runs one model at a time). A malformed
value raises ``ValueError`` at the first launch that reads it.

This module imports neither Triton nor CUDA: it is plain arithmetic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

# Read through engine/envs.py (its table documents them), imported when first read so that
# importing the kernels does not import the engine package.
DECODE_ENV = "KVSERVE_DECODE_CONFIG"
PREFILL_ENV = "KVSERVE_PREFILL_CONFIG"


@dataclass(frozen=True)
class DecodeLaunchConfig:
    """``_decode_kernel``: key tile ``block_n``; ``programs_per_sm`` is how many decode
    programs one SM keeps resident, which sets when ``choose_num_splits`` splits contexts."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int


@dataclass(frozen=True)
class PrefillLaunchConfig:
    """``_paged_attention_kernel``: query-row tile ``block_m`` (a row is one query token of
    one head of the GQA group), key tile ``block_n``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Bounds: tl.dot needs tiles of at least 16; Triton wants power-of-two warps and tiles.
_LIMITS = {"block_m": (16, 256), "block_n": (16, 256), "num_warps": (1, 32),
           "num_stages": (1, 8), "programs_per_sm": (1, 64)}
_POW2 = {"block_m", "block_n", "num_warps"}


def parse_launch_override(text: str, fields: tuple[str, ...], source: str) -> dict[str, int]:
    """Parse ``"KEY=int,KEY=int"`` (keys case-insensitive, e.g. ``BLOCK_N`` or ``block_n``)
    into ``{field: value}`` for the given ``fields``; raise ``ValueError`` naming ``source``
    for an unknown key, a repeated key, a non-integer, or a value out of range."""
    example = ",".join(f"{f.upper() if f.startswith('block') else f}=..." for f in fields)
    out: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in fields:
            raise ValueError(f"{source}: cannot read {item!r}; expected comma-separated "
                             f"KEY=integer pairs with KEY among {', '.join(fields)} "
                             f"(e.g. {example})")
        if key in out:
            raise ValueError(f"{source}: {key} is given twice")
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{source}: {key}={raw.strip()!r} is not an integer") from None
        lo, hi = _LIMITS[key]
        if not lo <= value <= hi or (key in _POW2 and value & (value - 1)):
            kind = "a power of two " if key in _POW2 else ""
            raise ValueError(f"{source}: {key}={value} must be {kind}in [{lo}, {hi}]")
        out[key] = value
    return out


@functools.cache
def _env_override(env: str, fields: tuple[str, ...]) -> dict[str, int]:
    """The parsed override in ``env``, read once per process (tests call ``cache_clear``)."""
    from engine import envs

    return parse_launch_override(envs.launch_override(env), fields, env)


_DECODE_FIELDS = ("block_n", "num_warps", "num_stages", "programs_per_sm")
_PREFILL_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


@functools.lru_cache(maxsize=64)
def decode_launch_config(head_dim: int, dtype: torch.dtype, is_cuda: bool) -> DecodeLaunchConfig:
    """Launch choices of the decode kernel for a model's head_dim and KV-cache dtype.

    GPU defaults (BLOCK_N 64, 4 warps, 2 stages, 4 resident programs per SM) were chosen by
    a sweep on an H200 at D=128, bf16 (see docs/decisions.md#triton-decode-launch-defaults);
    D=64 keeps them until a benchmark says otherwise. The CPU interpreter pays per op, so it gets few, mid-sized tiles.
    ``KVSERVE_DECODE_CONFIG`` overrides any of them.
    """
    block_d = 1 << max(0, head_dim - 1).bit_length()
    if is_cuda:
        cfg = DecodeLaunchConfig(block_n=64 if block_d <= 128 else 32, num_warps=4,
                                 num_stages=2, programs_per_sm=4)
    else:
        cfg = DecodeLaunchConfig(block_n=32, num_warps=4, num_stages=2, programs_per_sm=4)
    return replace(cfg, **_env_override(DECODE_ENV, _DECODE_FIELDS))


def prefill_launch_config(head_dim: int, dtype: torch.dtype, is_cuda: bool,
                          rows: int) -> PrefillLaunchConfig:
    """Launch choices of the prefill kernel for ``rows`` = longest query x GQA group.

    ``block_m`` follows the rows (16 / 32 / 64; 32 at most above head_dim 128, to bound
    registers) unless ``KVSERVE_PREFILL_CONFIG`` fixes it; 8 warps once a tile holds 8192
    query elements. Rows are bucketed, so each call is a cache hit after the first.
    """
    return _prefill_config(head_dim, dtype, is_cuda, _rows_bucket(rows))


def _rows_bucket(rows: int) -> int:
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


@functools.lru_cache(maxsize=64)
def _prefill_config(head_dim: int, dtype: torch.dtype, is_cuda: bool,
                    rows: int) -> PrefillLaunchConfig:
    block_d = 1 << max(0, head_dim - 1).bit_length()
    block_n = (64 if block_d <= 128 else 32) if is_cuda else 32
    cfg = PrefillLaunchConfig(block_m=0, block_n=block_n, num_warps=0, num_stages=2)
    cfg = replace(cfg, **_env_override(PREFILL_ENV, _PREFILL_FIELDS))
    block_m = cfg.block_m or (16 if rows <= 16 else (32 if rows <= 32 or block_d > 128 else 64))
    num_warps = cfg.num_warps or (8 if block_m * block_d >= 8192 else 4)
    return replace(cfg, block_m=block_m, num_warps=num_warps)


def clear_launch_config_cache() -> None:
    """Forget the parsed environment overrides and cached configs (for tests and sweeps
    that change the environment inside one process)."""
    _env_override.cache_clear()
    decode_launch_config.cache_clear()
    _prefill_config.cache_clear()
