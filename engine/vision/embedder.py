"""The runner's side of images: a step's placeholder rows and the embeddings that replace them.

A step's batch names, per image slice it computes, ``ImageRows(flat_row, image, first,
count)``: rows ``flat_row .. flat_row + count - 1`` of the packed batch are the image's soft
tokens ``first .. first + count - 1`` (a chunk may start inside an image whose earlier tokens
were a prefix-cache hit). :meth:`ImageEmbedder.rows` encodes every image of the step that the
encoder cache lacks, in one batch, and returns the rows' indices and embeddings for the model
to put in place of the placeholders' token embeddings (HF Gemma 3's ``masked_scatter``; the
image features are not scaled by the text embedding's normaliser).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.params.prompt_image import PromptImage
from engine.vision.encoder import ImageEncoder
from engine.vision.encoder_cache import EncoderCache


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Packed-batch rows ``flat_row ..`` hold soft tokens ``first .. first + count - 1`` of
    ``image``."""

    flat_row: int
    image: PromptImage
    first: int
    count: int


class ImageEmbedder:
    """The image encoder and its cache, on the runner's device."""

    def __init__(self, encoder: ImageEncoder, cache: EncoderCache | None = None) -> None:
        self.encoder = encoder
        self.cache = cache if cache is not None else EncoderCache()
        self.images_encoded = 0
        self.encode_seconds = 0.0

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.config.tokens_per_image

    def rows(self, image_rows: tuple[ImageRows, ...], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices [R] int64, embeddings [R, hidden])`` on ``device`` for ``image_rows``;
        images missing from the cache are encoded together, then cached."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, PromptImage] = {}
        for r in image_rows:
            key = r.image.key
            if key in found or key in missing:
                continue
            value = self.cache.get(key)
            if value is None:
                missing[key] = r.image
            else:
                found[key] = value
        if missing:
            found.update(self._encode(list(missing.values())))
        index, parts = [], []
        for r in image_rows:
            if r.first < 0 or r.first + r.count > self.tokens_per_image:
                raise ValueError(f"image rows {r.first}..{r.first + r.count} are outside the "
                                 f"image's {self.tokens_per_image} tokens")
            index.extend(range(r.flat_row, r.flat_row + r.count))
            parts.append(found[r.image.key][r.first:r.first + r.count])
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        return torch.tensor(index, dtype=torch.int64, device=device), rows.to(device)

    def _encode(self, images: list[PromptImage]) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        pixels = torch.stack([torch.as_tensor(i.pixels) for i in images])
        features = self.encoder.encode(pixels)
        self.encode_seconds += time.perf_counter() - start
        self.images_encoded += len(images)
        out = {}
        for image, value in zip(images, features):
            value = value.clone()  # its own storage: the cache holds it alone
            self.cache.put(image.key, value)
            out[image.key] = value
        return out
