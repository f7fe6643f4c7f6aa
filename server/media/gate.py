"""``refuse_unless_vision``: the one place that decides whether a request's images may reach
the model. Today no served model takes images, so every request with an image is refused
here, after its images were checked (a hostile or disallowed image gets its own 400 first)."""

from __future__ import annotations

from collections.abc import Sequence

from server.media.collect import ImageInput
from server.media.errors import MediaError


def refuse_unless_vision(model_takes_images: bool, images: Sequence[ImageInput], *,
                         model: str) -> None:
    """Nothing when ``images`` is empty or the model takes images; else ``MediaError`` 400
    naming the first image's field."""
    if images and not model_takes_images:
        raise MediaError(400, f"model {model} does not take images (a text-only model); send "
                              f"text only, or serve a model that takes images",
                         images[0].field)
