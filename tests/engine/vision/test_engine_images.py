"""Gemma 3 with images, end to end through the engine, against HF transformers.

A tiny random ``Gemma3ForConditionalGeneration`` (engine/loading/tiny_vision.py: 16 soft tokens
per image, sliding window 8 < the image's span) is served from its directory; the prompt is
its chat template with image parts, expanded as HF's processor does; greedy tokens must equal
HF's (its forward with ``token_type_ids``: the image's tokens attend both ways). Then the KV
cache: the same image again is a prefix hit, a different image after the same text is not
(its blocks are keyed by the image's content), and the encoder runs once per distinct image.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.loading.tiny_vision import make_tiny_gemma3_vision_dir
from engine.params.prompt_image import PromptImage
from engine.vision.images import hash_image, preprocess
from engine.vision.prompt_format import ImagePromptFormat
from tests.engine.vision.hf_vision_reference import (
    expand_images,
    hf_forward,
    hf_greedy,
    load_hf_vision,
    pixels_for,
)

TOKENS = 16  # soft tokens per image of the tiny checkpoint


def _picture(seed: int, size=(40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_gemma3_vision_dir(tmp_path_factory.mktemp("gemma3-vision"))


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              quantization="none", enable_prefix_caching=True, max_num_batched_tokens=24)
    yield llm
    llm.close()


def _prompt(llm: LLM, parts: list, images: list[Image.Image]):
    """(token ids, engine images, HF pixel values) of one user turn with ``parts`` ("text" or
    None for an image)."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    fmt: ImagePromptFormat = llm.engine.image_format
    assert fmt.expand(text) == expand_images(text, TOKENS)  # HF's processor's text
    ids = tok.encode(fmt.expand(text), add_special_tokens=False)
    config = llm.engine.runner.vision.encoder.config
    ours = preprocess(images, config) if images else None
    placed = tuple(PromptImage(hash_image(im), o, n, px)
                   for im, (o, n), px in zip(images, fmt.spans(ids), ours if images else []))
    return ids, placed, (pixels_for(images) if images else None)


def _greedy(llm: LLM, prompts, k: int = 8):
    params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
    outs = llm.generate([p[0] for p in prompts], params, images=[p[1] for p in prompts])
    return [o.outputs[0].token_ids for o in outs]


def test_one_and_two_images_equal_hf(llm, model_dir):
    """One image, two images, the image first and last; chunked prefill (24-token budget, so
    chunks are cut back to an image's start) and the sliding window (8) inside the images."""
    a, b = _picture(1), _picture(2, (70, 33))
    prompts = [_prompt(llm, ["What is in", None, "the picture?"], [a]),
               _prompt(llm, [None, "and", None, "differ how?"], [a, b]),
               _prompt(llm, ["Compare:", None], [b])]
    hf = load_hf_vision(model_dir)
    expected = [hf_greedy(hf, ids, px, 8) for ids, _, px in prompts]
    assert _greedy(llm, prompts) == expected
    llm.engine.kv.check_integrity()


def test_prompt_logprobs_equal_hf_at_every_position(llm, model_dir):
    """Greedy tokens alone can miss a mask error (random weights often answer alike); the log
    probability of every prompt token, the images' included, equals HF's (atol 1e-4), on one
    and two images, through chunks of 24 tokens."""
    hf = load_hf_vision(model_dir)
    for parts, images in ((["Look:", None, "ok?"], [_picture(3)]),
                          ([None, "vs", None, "?"], [_picture(4), _picture(5, (20, 90))])):
        ids, placed, px = _prompt(llm, parts, images)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([ids], params, images=[placed])[0]
        got = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        want = torch.log_softmax(hf_forward(hf, ids, px), -1)[:-1].gather(
            1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_image_mask_matters_for_these_weights(llm, model_dir):
    """The contrast that makes the test above meaningful: HF's logits with the image's tokens
    attending causally only differ from its logits with the bidirectional mask."""
    ids, _, px = _prompt(llm, ["Look:", None, "ok?"], [_picture(3)])
    hf = load_hf_vision(model_dir)
    both_ways, causal = hf_forward(hf, ids, px), hf_forward(hf, ids, px, image_mask=False)
    assert not torch.allclose(both_ways[-1], causal[-1], atol=1e-3)


def test_same_text_after_another_image_is_never_a_prefix_hit(llm, model_dir):
    """Request 1 with image A fills the cache; the same text with image B after it must hit
    only the blocks before B's first placeholder, and answer as HF does for B; the same text
    with A again hits every full block. With the media key dropped from the block hashes, B
    would be served A's K/V (and the hit count would cover the whole prompt)."""
    llm.engine.reset_prefix_cache()
    a, b = _picture(11), _picture(12)
    first, second, again = (_prompt(llm, ["Say what you see:", None, "Be brief."], [im])
                            for im in (a, b, a))
    assert first[0] == second[0]  # the same token ids: only the image differs
    hf = load_hf_vision(model_dir)
    _greedy(llm, [first])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out_b = llm.generate([second[0]], params, images=[second[1]])[0]
    offset = second[1][0].offset
    assert out_b.num_cached_tokens <= offset
    assert out_b.num_cached_tokens == offset // 4 * 4  # every full block before the image
    assert out_b.outputs[0].token_ids == hf_greedy(hf, second[0], second[2], 6)
    out_a = llm.generate([again[0]], params, images=[again[1]])[0]
    assert out_a.num_cached_tokens == (len(again[0]) - 1) // 4 * 4 and \
        out_a.num_cached_tokens > offset + TOKENS
    assert out_a.outputs[0].token_ids == hf_greedy(hf, again[0], again[2], 6)
    llm.engine.kv.check_integrity()


def test_the_encoder_runs_once_per_distinct_image(llm):
    """Two requests with the same picture (one re-encoded as another file: the key is the
    pixels') and one with another: two encodes, and the third request is a cache hit."""
    vision = llm.engine.runner.vision
    vision.cache._entries.clear()
    before = vision.images_encoded
    a, b = _picture(21), _picture(22)
    png = Image.open(io.BytesIO(_png(a)))
    prompts = [_prompt(llm, ["One:", None], [a]), _prompt(llm, ["Two:", None], [b]),
               _prompt(llm, ["Three:", None], [png])]
    assert prompts[0][1][0].key == prompts[2][1][0].key
    _greedy(llm, prompts[:2], 2)
    hits = vision.cache.hits
    _greedy(llm, prompts[2:], 2)
    assert vision.images_encoded - before == 2
    assert vision.cache.hits > hits


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_misplaced_images_are_refused(llm):
    """Images that do not sit on the prompt's placeholder runs, images for a prompt without
    placeholders, and placeholders without images: each a ValueError, nothing queued."""
    ids, placed, _ = _prompt(llm, ["See", None], [_picture(31)])
    params = SamplingParams(max_tokens=2)
    image = placed[0]
    shifted = PromptImage(image.key, image.offset + 1, image.length, image.pixels)
    for images, prompt in (((shifted,), ids), ((image,), [5, 6, 7]), ((), ids),
                           ((image, image), ids)):
        with pytest.raises(ValueError):
            llm.engine.add_request("bad", prompt, params, images=images)
    assert "bad" not in llm.engine.requests
