"""Helpers for the host-tier tests (no tests here): tiny real pools whose blocks hold a content id.

Each block of the device and host pools is one int64. ``compute`` writes, into a sequence's
blocks, the id of the KV the block would hold (a function of salt and the tokens up to the
block's end, as real KV is); ``flush`` runs the recorded copies with the PyTorch reference
``copy_blocks`` (the independent truth for what a copy does). After a flush, every block that
holds a hash, in either pool, must hold the content that hash names.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCacheManager, compute_block_hashes
from kvserve_kernels.reference import copy_blocks

_IDS: dict[tuple, int] = {}


def content_id(salt: tuple, tokens: list[int]) -> int:
    """A unique id for 'the KV of these tokens after this history' (stable within a run)."""
    return _IDS.setdefault((salt, tuple(tokens)), len(_IDS) + 1)


class Pools:
    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.dev = torch.zeros(m.num_blocks, 1, dtype=torch.int64)
        self.host = torch.zeros(m.host.num_blocks, 1, dtype=torch.int64)
        self.named: dict[bytes, int] = {}  # hash -> content id, learnt from hashlib, not m

    def copy(self, d2h, h2d) -> None:
        if d2h:
            copy_blocks(self.dev, self.host, torch.tensor(d2h, dtype=torch.int64))
        if h2d:
            copy_blocks(self.host, self.dev, torch.tensor(h2d, dtype=torch.int64))

    def flush(self):
        copies = self.m.flush_copies(self.copy)
        self.m.check_integrity()
        return copies

    def compute(self, seq: str, tokens: list[int], start: int, end: int, salt: tuple = ()):
        """The model writes positions [start, end) of ``seq``; then the scheduler commits."""
        bs, table = self.m.block_size, self.m.block_table(seq)
        for i in range(start // bs, -(-end // bs)):
            upto = min(end, (i + 1) * bs)
            self.dev[table[i]] = content_id(salt, tokens[:upto])
        for k, h in enumerate(compute_block_hashes(tokens[:end], bs, salt)):
            self.named[h] = content_id(salt, tokens[: (k + 1) * bs])
        self.m.commit(seq, tokens, end, salt)

    def expect_table(self, seq: str, tokens: list[int], computed: int, salt: tuple = ()):
        bs, table = self.m.block_size, self.m.block_table(seq)
        for i in range(-(-computed // bs)):
            want = content_id(salt, tokens[: min(computed, (i + 1) * bs)])
            assert int(self.dev[table[i]]) == want, f"{seq} block {i} holds the wrong KV"

    def check_named(self) -> None:
        """Every hash is resident where the manager says (call with no copies pending)."""
        assert not self.m.host.pending, "copies pending"
        for h, block in self.m.pool.cached.items():
            assert int(self.dev[block.block_id]) == self.named[h], "device block KV != its hash"
        for h, block in self.m.host.pool.cached.items():
            assert int(self.host[block.block_id]) == self.named[h], "host block KV != its hash"
