"""``collect.py`` and ``gate.py``: images found in the three API shapes with the field each
API names, the count limit (before anything is fetched), decode failures and the byte limit
naming the field, and the gate refusing valid images for a text-only model."""

from __future__ import annotations

import pytest

from engine.vision.images import ImageLimits, hash_image
from server.media.collect import (
    anthropic_image_refs,
    chat_image_refs,
    load_images,
    responses_image_refs,
)
from server.media.errors import MediaError
from server.media.gate import refuse_unless_vision
from server.media.limits import MediaSettings
from server.protocol import ChatMessage
from tests.server.media.pngs import data_url, huge_header_png, png, truncated_png

RED, BLUE = data_url(png()), data_url(png(color=(0, 0, 255)))


def _media_error(fn, *args, **kwargs) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn(*args, **kwargs)
    return info.value


def test_chat_parts_nested_and_bare():
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": RED, "detail": "low"}},
                    {"type": "image_url", "image_url": BLUE}]}]
    refs = chat_image_refs([ChatMessage.model_validate(m) for m in messages])
    assert [r.field for r in refs] == ["messages.1.content.1.image_url.url",
                                       "messages.1.content.2.image_url"]
    images = load_images(refs, MediaSettings())
    assert [i.field for i in images] == [r.field for r in refs]
    assert images[0].key == hash_image(images[0].image) != images[1].key
    assert images[0].image.size == (8, 6) and images[0].data.startswith(b"\x89PNG")
    assert chat_image_refs(messages) == refs  # dicts too


def test_responses_input_images():
    value = [{"role": "user", "content": "plain"},
             {"type": "function_call_output", "call_id": "c", "output": "x"},
             {"role": "user", "content": [{"type": "input_text", "text": "q"},
                                          {"type": "input_image", "image_url": RED,
                                           "detail": "auto"}]}]
    refs = responses_image_refs(value)
    assert [(r.field, r.ref) for r in refs] == [("input.2.content.1.image_url", RED)]
    assert responses_image_refs("a string input") == []
    err = _media_error(responses_image_refs, [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-123"}]}])
    assert err.field == "input.0.content.0.file_id" and "Files API" in err.message


def test_anthropic_image_blocks():
    b64 = RED.split(",", 1)[1]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]
    refs = anthropic_image_refs(messages)
    assert [(r.field, r.ref) for r in refs] == [
        ("messages.0.content.1.source.data", RED),
        ("messages.0.content.2.source.url", "https://example.com/a.png")]
    for source, field in (({"type": "file", "file_id": "f"}, "source.type"),
                          ({"type": "base64", "data": b64}, "source.media_type"),
                          ({"type": "url"}, "source.url"), (None, "source")):
        err = _media_error(anthropic_image_refs, [{"role": "user", "content": [
            {"type": "image", "source": source}]}])
        assert err.field == f"messages.0.content.0.{field}" and err.status == 400


def test_more_images_than_the_limit_is_400_naming_count_and_limit():
    refs = chat_image_refs([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://never.fetched/x.png"}}] * 3}])
    err = _media_error(load_images, refs, MediaSettings(max_images_per_request=2))
    assert err.status == 400 and "3 images" in err.message and "limit of 2" in err.message
    assert err.field == "messages.0.content.2.image_url.url"
    assert _media_error(load_images, refs[:1], MediaSettings(max_images_per_request=0)).field \
        == "messages.0.content.0.image_url.url"


@pytest.mark.parametrize("data,contains", [
    (truncated_png(), "truncated"),
    (b"\x00\x01random bytes" * 10, "not a PNG"),
    (huge_header_png(), "pixels"),
])
def test_undecodable_images_are_400_naming_the_field(data, contains):
    refs = chat_image_refs([{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": data_url(data)}]}])
    err = _media_error(load_images, refs, MediaSettings())
    assert err.status == 400 and err.field == "messages.0.content.1.image_url"
    assert contains in err.message and str(err).startswith(err.field)


def test_an_image_over_the_byte_limit_is_413_naming_the_field():
    refs = chat_image_refs([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": RED}}]}])
    err = _media_error(load_images, refs, MediaSettings(image_limits=ImageLimits(max_bytes=20)))
    assert err.status == 413 and err.field == "messages.0.content.0.image_url.url"


def test_the_gate_refuses_images_for_a_text_only_model():
    images = load_images(chat_image_refs([{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": RED},
        {"type": "image_url", "image_url": BLUE}]}]), MediaSettings())
    err = _media_error(refuse_unless_vision, False, images, model="smol")
    assert err.status == 400 and err.field == "messages.0.content.1.image_url"
    assert err.message.startswith("model smol does not take images (a text-only model)")
    refuse_unless_vision(False, [], model="smol")  # no images: nothing to refuse
    refuse_unless_vision(True, images, model="gemma")  # a vision model takes them
