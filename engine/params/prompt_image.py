"""An image in a prompt, as the engine takes it (Gemma 3's vision input).

The caller (the server) has already decoded and preprocessed the image and put its
placeholders in the prompt: ``length`` consecutive image tokens from position ``offset``. The
engine replaces those placeholders' embeddings with the image encoder's output, lets the span
attend to itself both ways, keys the span's KV blocks by ``key`` (the prefix cache: the same
text after another image is never a hit) and runs the encoder once per distinct ``key`` (the
encoder cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of one prompt. ``pixels`` is the preprocessed ``[3, S, S]`` float tensor
    (``engine.vision.images.preprocess``), ``key`` a content hash of the decoded pixels
    (``engine.vision.images.hash_image``): equal keys mean equal pictures."""

    key: str
    offset: int  # the position of the first placeholder in the prompt
    length: int  # placeholders: the encoder's tokens per image
    pixels: Any  # torch.Tensor [3, S, S] (typed loosely: this floor imports no torch)

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("PromptImage.key must be a non-empty string")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"PromptImage.offset must be an int >= 0, got {self.offset!r}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"PromptImage.length must be an int >= 1, got {self.length!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions ``[start, end)`` hold any of this image's placeholders."""
        return self.offset < end and start < self.end
