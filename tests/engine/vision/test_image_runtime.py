"""The pieces between a prompt's images and the model: where chunks may end, the encoder cache,
the prompt format's spans and checks, and the server's placing of images on them."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine.params.prompt_image import PromptImage
from engine.scheduling.image_chunks import chunk_images, fit_chunk
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_format import ImagePromptFormat

FMT = ImagePromptFormat(marker="<boi>", expansion="\n\n<boi><img><img><img><eoi>\n\n",
                        image_token_id=9, tokens_per_image=3)


def _image(offset: int, length: int = 10, key: str = "k") -> PromptImage:
    return PromptImage(key, offset, length, None)


def test_a_chunk_never_ends_inside_an_image():
    images = [_image(10), _image(30)]  # spans [10, 20) and [30, 40)
    assert fit_chunk(images, 0, 15, 50) == 10  # cut back to the image's start
    assert fit_chunk(images, 0, 10, 50) == 10  # ends right before it: as asked
    assert fit_chunk(images, 0, 20, 50) == 20  # ends right after it
    assert fit_chunk(images, 12, 5, 38) == 0  # starts inside (a prefix hit): waits for room
    assert fit_chunk(images, 12, 8, 38) == 8  # reaches its end
    assert fit_chunk(images, 0, 35, 50) == 30  # the second image is cut at its start
    assert fit_chunk(images, 0, 15, 15) == 15  # the prompt's rest: nothing to cut
    assert fit_chunk([], 0, 15, 50) == 15
    assert chunk_images(images, 0, 10) == ()
    assert chunk_images(images, 5, 30) == tuple(images)
    assert chunk_images(images, 19, 1) == (images[0],)


def test_prompt_image_is_validated():
    for bad in (dict(key="", offset=0, length=1), dict(key="k", offset=-1, length=1),
                dict(key="k", offset=0, length=0), dict(key="k", offset=True, length=1)):
        with pytest.raises(ValueError):
            PromptImage(pixels=None, **bad)
    assert _image(4, 3).overlaps(6, 9) and not _image(4, 3).overlaps(7, 9)


def test_the_encoder_cache_is_lru_and_bounded_in_bytes():
    row = torch.zeros(4, 8)  # 128 bytes
    cache = EncoderCache(max_bytes=3 * 128)
    for key in "abc":
        cache.put(key, row.clone())
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", row.clone())  # b, the least recent, leaves
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.bytes == 3 * 128 and cache.evictions == 1
    cache.put("huge", torch.zeros(100, 8))  # larger than the budget: not kept, nothing lost
    assert "huge" not in cache and len(cache) == 3
    assert cache.get("zz") is None and cache.misses == 1 and cache.hits == 1
    cache.put("a", torch.zeros(2, 8))  # replaced: its bytes recounted
    assert cache.bytes == 2 * 128 + 64
    with pytest.raises(ValueError):
        EncoderCache(max_bytes=-1)


def test_the_prompt_format_finds_and_checks_the_image_runs():
    assert FMT.expand("a<boi>b") == "a\n\n<boi><img><img><img><eoi>\n\nb"
    ids = [1, 9, 9, 9, 2, 9, 9, 9]
    assert FMT.spans(ids) == [(1, 3), (5, 3)]
    FMT.check((_image(1, 3), _image(5, 3)), ids)
    FMT.check((), [1, 2, 3])
    for images, prompt in (((_image(1, 3),), ids),  # one image for two runs
                           ((), ids),  # placeholders without images
                           ((_image(2, 3), _image(5, 3)), ids),  # off its run
                           ((_image(1, 2),), [1, 9, 9, 2])):  # a run of the wrong length
        with pytest.raises(ValueError):
            FMT.check(images, prompt)
    with pytest.raises(ValueError):
        ImagePromptFormat(marker="<x>", expansion="<y>", image_token_id=1, tokens_per_image=1)


def test_the_server_places_images_on_the_runs_in_order():
    from engine.vision.config import VisionConfig
    from server.media.collect import ImageInput
    from server.media.prompt import ImagePrompts

    vision = VisionConfig(image_size=16, patch_size=8, hidden_size=8, intermediate_size=8,
                          num_layers=1, num_heads=1, mm_tokens_per_image=1, text_hidden_size=8)
    prompts = ImagePrompts(FMT, vision)
    red, blue = (ImageInput(f"messages.0.content.{i}", b"", Image.new("RGB", (5, 7), c), k)
                 for i, (c, k) in enumerate((((255, 0, 0), "red"), ((0, 0, 255), "blue"))))
    placed = prompts.place([red, blue], [1, 9, 9, 9, 2, 9, 9, 9])
    assert [(p.key, p.offset, p.length) for p in placed] == [("red", 1, 3), ("blue", 5, 3)]
    assert placed[0].pixels.shape == (3, 16, 16) and placed[0].pixels[0].mean() > 0.9
    with pytest.raises(ValueError, match="chat template placed 1 image"):
        prompts.place([red, blue], [1, 9, 9, 9])
