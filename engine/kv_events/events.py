"""The KV cache events, vLLM's schema (``vllm.distributed.kv_events``), and their wire form.

One ZMQ message per batch: three frames, ``topic``, the batch's sequence number (8 bytes,
big-endian) and a msgpack array ``[ts, [event, ...], data_parallel_rank]``. Each event is a
msgpack map tagged by ``"type"`` (msgspec's ``tag=True`` encoding, which vLLM uses and routers
such as vllm-router require); optional fields are left out when unset (``omit_defaults``).

Block hashes are kvserve's own chained SHA-256 digests (32 bytes, msgpack ``bin``): routers treat
them as opaque keys and hash the ``token_ids`` themselves to match a request's prompt.
``medium`` uses vLLM's spellings: ``GPU`` the device pool (also on a CPU device), ``CPU`` the
host tier, ``DISK`` the disk tier, ``STORAGE`` the remote store when it is the only tier below
the host (with a disk tier too, a block written to both is announced once, as ``DISK``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "STORAGE"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)

# vLLM's KVCacheSpecKind values for the groups of a hybrid cache.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class GroupSpec:
    """What a BlockStored of a hybrid cache's group says about the group."""

    group_idx: int
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_WINDOW


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became available in ``medium``: a run where block ``i``'s parent is block
    ``i - 1`` and the first one's is ``parent_block_hash`` (None: the first block of a prompt).
    ``token_ids`` holds ``block_size`` tokens per block."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    group: GroupSpec | None = None  # a hybrid cache's group (None: the only group)
    lora_id: int | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("a BlockStored event names at least one block")
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(f"{len(self.block_hashes)} blocks of {self.block_size} tokens but "
                             f"{len(self.token_ids)} token ids")
        if self.medium not in MEDIA:
            raise ValueError(f"unknown medium {self.medium!r}; one of {', '.join(MEDIA)}")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
            "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
            "lora_name": self.lora_name}
        if self.group is not None:
            out["group_idx"] = self.group.group_idx
            out["kv_cache_spec_kind"] = self.group.kind
            if self.group.sliding_window is not None:
                out["kv_cache_spec_sliding_window"] = self.group.sliding_window
        return out


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left ``medium`` (evicted, overwritten, rolled back)."""

    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU
    group_idx: int | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("a BlockRemoved event names at least one block")
        if self.medium not in MEDIA:
            raise ValueError(f"unknown medium {self.medium!r}; one of {', '.join(MEDIA)}")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(self.block_hashes),
                               "medium": self.medium}
        if self.group_idx is not None:
            out["group_idx"] = self.group_idx
        return out


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: forget every block of this engine, every medium."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine step."""

    ts: float
    events: tuple[KVCacheEvent, ...] = field(default=())
    data_parallel_rank: int = 0

    def encode(self) -> bytes:
        """The msgpack payload (the message's third frame)."""
        return msgpack.packb([self.ts, [e.to_wire() for e in self.events],
                              self.data_parallel_rank], use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    """A sequence number as its frame: 8 bytes, big-endian, signed (-1 ends a replay)."""
    return seq.to_bytes(8, "big", signed=True)


END_OF_REPLAY = seq_frame(-1)
