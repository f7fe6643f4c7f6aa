"""``--kv-eviction sink:S,window:N``: the streaming-eviction setting, parsed and checked.

Plain data with no engine imports (``EngineConfig`` validates the format through it). Sizes
are in tokens; the policy works in whole blocks, each rounded UP (``blocks``). The policy
itself is ``engine.kv_cache.streaming``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"\s*sink\s*:\s*(\d+)\s*,\s*window\s*:\s*(\d+)\s*")


@dataclass(frozen=True)
class KVEvictionSpec:
    """``sink:S,window:N`` in tokens, and its block-aligned form for one ``block_size``."""

    sink: int
    window: int

    @classmethod
    def parse(cls, text: str) -> KVEvictionSpec:
        m = _SPEC.fullmatch(text or "")
        if m is None:
            raise ValueError(f"kv_eviction must read 'sink:S,window:N' (e.g. sink:4,window:1024; "
                             f"S >= 0 attention-sink tokens kept, N recent tokens kept); got "
                             f"{text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def blocks(self, block_size: int) -> tuple[int, int]:
        """(sink blocks, window blocks), each rounded up to whole blocks."""
        return -(-self.sink // block_size), -(-self.window // block_size)

    def max_cache_tokens(self, block_size: int) -> int:
        """The most tokens a decoding sequence holds: sinks, window and the block being
        filled."""
        s, w = self.blocks(block_size)
        return (s + w + 1) * block_size

    def validate(self, block_size: int, max_model_len: int) -> None:
        """ValueError unless the window spans at least two blocks and the rounded sinks,
        window and one partial block fit ``max_model_len``."""
        s, w = self.blocks(block_size)
        if w < 2:
            raise ValueError(f"kv_eviction window must span at least 2 blocks of {block_size} "
                             f"tokens (>= {2 * block_size}); got window:{self.window}")
        need = self.max_cache_tokens(block_size)
        if need > max_model_len:
            raise ValueError(
                f"kv_eviction sink:{self.sink},window:{self.window} keeps up to {need} tokens "
                f"({s} sink + {w} window blocks of {block_size}, plus the block being filled) "
                f"but max_model_len is {max_model_len}: the cache positions must stay inside "
                f"the context; lower the window or raise max_model_len")

    def describe(self, block_size: int) -> str:
        s, w = self.blocks(block_size)
        return (f"sink:{self.sink},window:{self.window} -> {s} sink + {w} window blocks of "
                f"{block_size} tokens (at most {self.max_cache_tokens(block_size)} cached "
                f"tokens per sequence)")
