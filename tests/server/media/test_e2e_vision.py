"""Images served end to end: ``kvserve serve`` (a subprocess, real uvicorn) on a tiny random
Gemma 3 vision checkpoint, the real ``openai`` and ``anthropic`` SDKs sending images, HF
transformers' greedy continuation as the truth (the prompt rendered and expanded as HF's
processor does, HF's own image processor's pixels)."""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from engine.loading.tiny_vision import make_tiny_gemma3_vision_dir
from tests.engine.vision.hf_vision_reference import (
    expand_images,
    hf_greedy,
    load_hf_vision,
    pixels_for,
)
from tests.server.helpers import start_server_process
from tests.server.media.pngs import truncated_png

TOKENS = 16
MAX_TOKENS = 6


def _png(seed: int, size=(40, 52)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vision-e2e")
    model = make_tiny_gemma3_vision_dir(tmp / "model")
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", str(model), "--dtype", "float32", "--quantization",
         "none", "--block-size", "4", "--kv-cache-memory", "8MiB",
         "--max-num-batched-tokens", "24", "--served-model-name", "tiny-vision"],
        tmp / "server.log", timeout=300)
    try:
        yield model, url, tmp / "server.log"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _expected(model, parts: list, pngs: list[bytes]) -> tuple[str, list[int]]:
    """HF's greedy text for one user turn (``parts``: text, or None for the next image) and
    its prompt's token ids."""
    tok = AutoTokenizer.from_pretrained(model)
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(expand_images(text, TOKENS), add_special_tokens=False)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    out = hf_greedy(load_hf_vision(model), ids, pixels_for(images), MAX_TOKENS)
    return tok.decode(out, skip_special_tokens=True), ids


def _chat_content(parts: list, pngs: list[bytes]) -> list[dict]:
    it = iter(pngs)
    return [{"type": "image_url", "image_url": {"url": _url(next(it))}} if p is None else
            {"type": "text", "text": p} for p in parts]


def test_openai_sdk_image_url_parts_answer_as_hf(vision_server):
    """One image, then the same text with another image (never a prefix hit past the image's
    first block), then two images; every answer HF's, cached tokens as the KV keys say."""
    model, url, log = vision_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    a, b = _png(1), _png(2, (64, 30))
    for parts, pngs in ((["What is in", None, "the picture?"], [a]),
                        (["What is in", None, "the picture?"], [b]),
                        ([None, "and", None, "differ how?"], [a, b])):
        want, ids = _expected(model, parts, pngs)
        r = client.chat.completions.create(
            model="tiny-vision", temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": _chat_content(parts, pngs)}],
            extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(ids)
    # the same text and image again: a hit past the image; another image: a hit on the 4-token
    # blocks before the image's first soft token only
    _, ids = _expected(model, ["What is in", None, "the picture?"], [b])
    offset = ids.index(262)  # the first <image_soft_token>
    second = client.chat.completions.create(
        model="tiny-vision", temperature=0, max_tokens=1,
        messages=[{"role": "user", "content": _chat_content(["What is in", None,
                                                             "the picture?"], [b])}])
    assert second.usage.prompt_tokens_details.cached_tokens > offset + TOKENS
    c = client.chat.completions.create(
        model="tiny-vision", temperature=0, max_tokens=1,
        messages=[{"role": "user", "content": _chat_content(["What is in", None,
                                                             "the picture?"], [_png(3)])}])
    assert c.usage.prompt_tokens_details.cached_tokens == offset // 4 * 4
    assert "Traceback" not in log.read_text()


def test_responses_and_messages_take_the_same_images(vision_server):
    """Responses ``input_image`` and Anthropic ``image`` blocks reach the same prompt: the
    same answer as HF's."""
    model, url, _ = vision_server
    a = _png(7)
    want, _ = _expected(model, ["Describe", None], [a])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.responses.create(model="tiny-vision", temperature=0,
                                max_output_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
                                input=[{"role": "user", "content": [
                                    {"type": "input_text", "text": "Describe"},
                                    {"type": "input_image", "image_url": _url(a)}]}])
    assert r.output_text == want
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    m = claude.messages.create(model="tiny-vision", max_tokens=MAX_TOKENS,
                               extra_body={"ignore_eos": True, "temperature": 0},
                               messages=[{"role": "user", "content": [
                                   {"type": "text", "text": "Describe"},
                                   {"type": "image", "source": {
                                       "type": "base64", "media_type": "image/png",
                                       "data": base64.b64encode(a).decode()}}]}])
    assert m.content[0].text == want


def test_bad_images_and_markers_are_400s_and_the_server_serves_on(vision_server):
    """A truncated PNG, and a text holding the image marker itself (one image too many for
    the template's markers): 400s naming the field; a good image is served afterwards."""
    model, url, log = vision_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    for content, param in (
            (_chat_content([None], [truncated_png()]), "messages.0.content.0.image_url.url"),
            (_chat_content(["<start_of_image>", None], [_png(8)]), "messages")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-vision", max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
        assert err.value.body["param"] == param
    r = client.chat.completions.create(model="tiny-vision", max_tokens=2, messages=[
        {"role": "user", "content": _chat_content(["ok", None], [_png(9)])}])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "Traceback" not in log.read_text()
