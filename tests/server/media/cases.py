"""The requests the API tests send: bad images each API must refuse with a 400 naming the
field, as (label, reference) pairs, and the three API shapes of one image."""

from __future__ import annotations

from tests.server.media.pngs import data_url, huge_header_png, png, truncated_png

VALID = data_url(png())
BAD = [("truncated PNG", data_url(truncated_png()), "truncated"),
       ("random bytes", data_url(b"\x13\x37 not an image at all" * 8), "not a PNG"),
       ("20000x20000 header", data_url(huge_header_png()), "pixels"),
       ("disallowed http URL", "http://169.254.169.254/latest/meta-data", "allowed-media-domains"),
       ("file outside the allowed path", "file:///etc/passwd", "--allowed-local-media-path")]


def chat_image(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in the image?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def responses_image(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                         {"type": "input_image", "image_url": url}]}]


def anthropic_image(url: str) -> list[dict]:
    if url.startswith("data:"):
        media_type, data = url[5:].split(";base64,", 1)
        source = {"type": "base64", "media_type": media_type, "data": data}
    else:
        source = {"type": "url", "url": url}
    return [{"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                         {"type": "image", "source": source}]}]


def anthropic_field(url: str) -> str:
    return "messages.0.content.1.source." + ("data" if url.startswith("data:") else "url")
