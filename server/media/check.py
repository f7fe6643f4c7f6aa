"""``checked_images``: what a route calls for a request's images: found (``collect.py``),
loaded off the event loop, and passed through the gate (``gate.py``); every refusal an
``APIError`` with the status of its ``MediaError``, the field as ``param`` and at the head of
the message (the Messages API's error shape has no ``param``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from server.errors import APIError
from server.media.collect import ImageInput, ImageRef, load_images
from server.media.errors import MediaError
from server.media.gate import refuse_unless_vision
from server.media.limits import MediaSettings


def api_error(exc: MediaError) -> APIError:
    """``exc`` as the server's error (OpenAI's shape; the Messages API's middleware rewrites
    it into Anthropic's)."""
    return APIError(exc.status, str(exc), param=exc.field)


async def checked_images(find: Callable[[Any], Sequence[ImageRef]], messages: Any,
                         settings: MediaSettings, *, model: str, takes_images: bool
                         ) -> list[ImageInput]:
    """The images ``find`` (one of collect.py's ``*_image_refs``) lists in ``messages``, each
    checked and decoded; [] without any. ``APIError`` for a refused image, and for any image
    while the model takes none."""
    try:
        refs = find(messages)
        if not refs:
            return []
        images = await asyncio.to_thread(load_images, refs, settings)
        refuse_unless_vision(takes_images, images, model=model)
    except MediaError as exc:
        raise api_error(exc) from None
    return images
