"""The encoder cache: each distinct image's soft-token embeddings, kept while room lasts.

Keyed by the image's content hash (``PromptImage.key``), so the same picture sent again (a
follow-up turn, another user, a re-encoded file of the same pixels) skips the vision tower.
Least recently used entries leave first once the entries' bytes pass ``max_bytes``; an entry
larger than the whole budget is not kept. One thread uses it (the engine's).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


class EncoderCache:
    """An LRU map from image key to its ``[tokens, hidden]`` embeddings, bounded in bytes."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The embeddings of ``key`` (now the most recently used), or None; counted."""
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used past the budget."""
        size = value.numel() * value.element_size()
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        if size > self.max_bytes:
            return
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.numel() * gone.element_size()
            self.evictions += 1
