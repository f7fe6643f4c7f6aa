"""Where an image's soft tokens go in Gemma 3's prompt, and finding them again.

Gemma 3's chat template writes one ``<start_of_image>`` per image part; HF's processor then
replaces each with ``"\\n\\n<start_of_image>" + tokens_per_image * "<image_soft_token>" +
"<end_of_image>\\n\\n"`` before tokenising (``Gemma3Processor.full_image_sequence``), and the
model swaps the soft tokens' embeddings for the image encoder's output. kvserve does the same:
:meth:`ImagePromptFormat.expand` on the rendered text, then :meth:`ImagePromptFormat.spans` on
the token ids gives each image's ``(offset, length)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.params.prompt_image import PromptImage


@dataclass(frozen=True)
class ImagePromptFormat:
    """The markers of one model's image prompt. ``marker`` is what the chat template writes
    per image, ``expansion`` the text it becomes (holding ``tokens_per_image`` image tokens),
    ``image_token_id`` the soft token's id."""

    marker: str
    expansion: str
    image_token_id: int
    tokens_per_image: int

    def __post_init__(self) -> None:
        if not self.marker or self.marker not in self.expansion:
            raise ValueError("the expansion of an image marker must hold the marker")
        if self.tokens_per_image < 1:
            raise ValueError(f"tokens_per_image must be >= 1, got {self.tokens_per_image}")

    def count(self, text: str) -> int:
        """How many images the rendered ``text`` has room for."""
        return text.count(self.marker)

    def expand(self, text: str) -> str:
        """``text`` with every image marker replaced by its full image sequence."""
        return text.replace(self.marker, self.expansion)

    def spans(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """``(offset, length)`` of every run of image tokens in ``token_ids``, in order."""
        out: list[tuple[int, int]] = []
        start = -1
        tok = self.image_token_id
        for i, t in enumerate(token_ids):
            if t == tok and start < 0:
                start = i
            elif t != tok and start >= 0:
                out.append((start, i - start))
                start = -1
        if start >= 0:
            out.append((start, len(token_ids) - start))
        return out

    def check(self, images: tuple[PromptImage, ...], token_ids: list[int]) -> None:
        """``ValueError`` (user-facing) unless ``images`` sit exactly on the image-token runs
        of ``token_ids``, one image per run, in order, each ``tokens_per_image`` long."""
        runs = self.spans(token_ids)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder runs for "
                             f"{len(images)} images")
        for i, (image, (offset, length)) in enumerate(zip(images, runs)):
            if (image.offset, image.length) != (offset, length):
                raise ValueError(f"image {i} claims tokens {image.offset}..{image.end - 1} "
                                 f"but its placeholders are {offset}..{offset + length - 1}")
            if length != self.tokens_per_image:
                raise ValueError(f"image {i} has {length} placeholders; the model's images "
                                 f"take {self.tokens_per_image}")

    @classmethod
    def for_gemma3(cls, hf_config: Any, tokenizer: Any, tokens_per_image: int
                   ) -> ImagePromptFormat:
        """From a ``Gemma3Config`` (its image, begin- and end-of-image token ids) and the
        tokenizer that spells them; a text model's config (a GGUF's, served with an mmproj)
        has no such ids: the tokenizer's Gemma 3 spellings are looked up instead.
        ``ValueError`` naming what is missing."""
        def token_id(spelling: str, *names: str) -> int:
            for name in names:
                value = getattr(hf_config, name, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
            value = tokenizer.convert_tokens_to_ids(spelling)
            if isinstance(value, int) and value != tokenizer.unk_token_id:
                return value
            raise ValueError(f"the model has no {spelling} token (config {names[0]})")

        image = token_id("<image_soft_token>", "image_token_id", "image_token_index")
        boi = token_id("<start_of_image>", "boi_token_id", "boi_token_index")
        eoi = token_id("<end_of_image>", "eoi_token_id", "eoi_token_index")
        image_s, boi_s, eoi_s = tokenizer.convert_ids_to_tokens([image, boi, eoi])
        for tid, text in ((image, image_s), (boi, boi_s), (eoi, eoi_s)):
            if not text or tokenizer.convert_tokens_to_ids(text) != tid:
                raise ValueError(f"the tokenizer does not spell token {tid} as one token")
        return cls(marker=boi_s,
                   expansion=f"\n\n{boi_s}{image_s * tokens_per_image}{eoi_s}\n\n",
                   image_token_id=image, tokens_per_image=tokens_per_image)
