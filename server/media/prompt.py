"""Putting a request's images into its prompt, for a model that takes them.

The chat template writes one marker per ``{"type": "image"}`` part (``protocol.conversation``
turns each image part into one); :meth:`ImagePrompts.expand` makes each marker the model's full
image sequence before tokenising, and :meth:`ImagePrompts.place` pairs the token ids' image
runs with the request's images, in order, as the engine's ``PromptImage`` (pixels preprocessed,
content key, span). A template that drops or repeats an image part is a 400, never a silently
different prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.params.prompt_image import PromptImage
from engine.vision.config import VisionConfig
from engine.vision.images import preprocess
from engine.vision.prompt_format import ImagePromptFormat
from server.media.collect import ImageInput


@dataclass(frozen=True)
class ImagePrompts:
    """The served model's image prompt format and the pixels its encoder expects."""

    fmt: ImagePromptFormat
    vision: VisionConfig

    def expand(self, text: str) -> str:
        return self.fmt.expand(text)

    def place(self, images: Sequence[ImageInput], token_ids: list[int]
              ) -> tuple[PromptImage, ...]:
        """The engine's images for a prompt rendered with ``expand``; ``ValueError`` when its
        image runs do not match ``images`` one to one. Blocking (resizes pixels)."""
        spans = self.fmt.spans(token_ids)
        if len(spans) != len(images):
            raise ValueError(f"the chat template placed {len(spans)} image(s) for the "
                             f"{len(images)} image(s) of the request (an image marker in the "
                             f"text, or a template that does not render image parts?)")
        if not images:
            return ()
        pixels = preprocess([i.image for i in images], self.vision)
        return tuple(PromptImage(key=i.key, offset=offset, length=length, pixels=p)
                     for i, (offset, length), p in zip(images, spans, pixels))


def image_prompts(engine: object) -> ImagePrompts | None:
    """The served model's ``ImagePrompts`` (an ``AsyncEngine`` over a core whose runner
    loaded an image encoder), or None for a text-only model."""
    core = getattr(engine, "core", None)
    fmt = getattr(core, "image_format", None)
    vision = getattr(getattr(core, "runner", None), "vision", None)
    if fmt is None or vision is None:
        return None
    return ImagePrompts(fmt, vision.encoder.config)
