"""The images of a request: found in each API's shape, fetched, decoded and keyed.

``*_image_refs`` walk a request's messages and list its images as ``ImageRef`` (the field, as
the API names it, and the reference): OpenAI chat content parts ``{"type": "image_url",
"image_url": {"url", "detail"?}}`` (or ``"image_url": "<url>"``, as some clients send), the
Responses API's ``{"type": "input_image", "image_url", "detail"?}`` (a ``file_id`` is refused:
there is no Files API), Anthropic's image blocks ``{"type": "image", "source": {"type":
"base64", "media_type", "data"}}`` or ``{"type": "url", "url"}``. The walk refuses what it
cannot read (``MediaError`` naming the field); the request models have checked the shapes.

``load_images(refs, settings)`` turns them into ``ImageInput``: more than
``max_images_per_request`` is a 400 naming the count and the limit (before anything is
fetched); then each image's bytes (``sources.fetch_image_bytes``) are decoded under
``image_limits`` (a decode failure is a 400 naming the field and the problem; over the byte
limit a 413) and keyed by ``engine.vision.images.hash_image``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from engine.vision.images import ImageError, decode_image, hash_image
from server.media.errors import MediaError
from server.media.limits import MediaSettings
from server.media.sources import fetch_image_bytes


@dataclass(frozen=True)
class ImageRef:
    """An image a request refers to: ``field`` (dotted, e.g.
    ``messages.0.content.1.image_url.url``) and ``ref`` (a data:, file:// or http(s) URL)."""

    field: str
    ref: str


@dataclass(frozen=True)
class ImageInput:
    """An image of a request, usable: ``field`` where it was given, ``data`` its encoded bytes,
    ``image`` the decoded picture (pixels loaded), ``key`` its content key (``hash_image``:
    the same picture re-encoded has the same key)."""

    field: str
    data: bytes = field(repr=False)
    image: Image.Image = field(repr=False, compare=False)
    key: str


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else \
        getattr(message, "content", None)


def _parts(items: Iterable[Any], kind: str) -> Iterator[tuple[int, int, dict]]:
    """``(i, j, part)`` for each dict part of type ``kind`` in the list content of each of
    ``items`` (messages or input items, objects or dicts)."""
    for i, item in enumerate(items):
        content = _content(item)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == kind:
                yield i, j, part


def chat_image_refs(messages: Iterable[Any]) -> list[ImageRef]:
    """The ``image_url`` parts of chat messages (``ChatMessage`` objects or dicts)."""
    refs = []
    for i, j, part in _parts(messages, "image_url"):
        where = f"messages.{i}.content.{j}.image_url"
        value = part.get("image_url")
        if isinstance(value, dict):
            value, where = value.get("url"), f"{where}.url"
        if not isinstance(value, str):
            raise MediaError(400, "an image_url part needs a URL string", where)
        refs.append(ImageRef(where, value))
    return refs


def responses_image_refs(value: Any) -> list[ImageRef]:
    """The ``input_image`` parts of a Responses request's ``input`` (as sent: the fields
    index it)."""
    if not isinstance(value, list):
        return []
    refs = []
    for i, j, part in _parts(value, "input_image"):
        where = f"input.{i}.content.{j}"
        url = part.get("image_url")
        if isinstance(url, dict):  # lenient: the chat API's nested shape
            url = url.get("url")
        if part.get("file_id") is not None and url is None:
            raise MediaError(400, "file_id is not supported: this server has no Files "
                                  "API; send image_url (a data: URL)", f"{where}.file_id")
        if not isinstance(url, str):
            raise MediaError(400, "an input_image part needs image_url (a URL string)",
                             f"{where}.image_url")
        refs.append(ImageRef(f"{where}.image_url", url))
    return refs


def anthropic_image_refs(messages: Iterable[Any]) -> list[ImageRef]:
    """The ``image`` blocks of Anthropic messages (``AnthropicMessage`` objects or dicts); a
    base64 source becomes a data: URL of its media type."""
    return [anthropic_source_ref(block.get("source"), f"messages.{i}.content.{j}.source")
            for i, j, block in _parts(messages, "image")]


def anthropic_source_ref(source: Any, where: str) -> ImageRef:
    """An Anthropic image block's ``source`` (at ``where``) as an ``ImageRef``, or
    ``MediaError`` naming what is missing."""
    if not isinstance(source, dict):
        raise MediaError(400, "an image block needs a source object", where)
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type:
            raise MediaError(400, "a base64 source needs a media_type (image/png, ...)",
                             f"{where}.media_type")
        if not isinstance(data, str):
            raise MediaError(400, "a base64 source needs its data as a string",
                             f"{where}.data")
        return ImageRef(f"{where}.data", f"data:{media_type};base64,{data}")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise MediaError(400, "a url source needs a url string", f"{where}.url")
        return ImageRef(f"{where}.url", url)
    raise MediaError(400, f"image sources of type {kind!r} are not supported: base64 or url "
                          f"(there is no Files API)", f"{where}.type")


def load_images(refs: Sequence[ImageRef], settings: MediaSettings) -> list[ImageInput]:
    """The images of ``refs``, fetched, decoded and keyed, in order (see the module's
    docstring for the refusals). Blocking: file and network reads, decoding."""
    limit = settings.max_images_per_request
    if len(refs) > limit:
        raise MediaError(400, f"the request holds {len(refs)} images, over the limit of "
                              f"{limit} per request (--limit-mm-per-prompt)", refs[limit].field)
    out = []
    for ref in refs:
        try:
            data = fetch_image_bytes(ref.ref, settings)
            image = decode_image(data, settings.image_limits)
        except MediaError as exc:
            raise exc.at(ref.field) from None
        except ImageError as exc:
            raise MediaError(400, f"the image cannot be used: {exc}", ref.field) from None
        out.append(ImageInput(ref.field, data, image, hash_image(image)))
    return out
