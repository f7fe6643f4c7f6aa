"""Shared by the disk-tier unit tests: block hashes and their known payloads (any wrong block
read back would differ), and filling a store and reading it back."""

from __future__ import annotations

import hashlib

BLOCK = 1000


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload(h: bytes) -> bytes:
    """The truth for a hash: its bytes repeated."""
    return (h * (BLOCK // 32 + 1))[:BLOCK]


def submit_all(store, ids) -> int:
    """Submit blocks ``ids`` and wait for the writer; returns how many were queued."""
    queued = sum(store.submit(block_hash(i), payload(block_hash(i))) for i in ids)
    store.flush()
    return queued


def readable(store, ids) -> int:
    """How many of ``ids`` read back; every one that does is the right block."""
    found = 0
    for i in ids:
        got = store.read(block_hash(i))
        if got is not None:
            assert got == payload(block_hash(i))
            found += 1
    return found


def fill(store, ids) -> None:
    """``submit_all``, every block queued."""
    ids = list(ids)
    assert submit_all(store, ids) == len(ids)
