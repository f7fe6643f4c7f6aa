"""Images through every route that takes messages, on the fake engine (no model): the real
``openai`` and ``anthropic`` SDKs against a uvicorn server. A valid image (a data: URL, or a
file under --allowed-local-media-path) gets the 400 "does not take images" naming the image's
field; a hostile or disallowed one its own 400 naming the field (Anthropic's shape: in the
message); more images than --limit-mm-per-prompt a 400; the server keeps serving text."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread, assert_error
from tests.server.media.cases import (
    BAD,
    VALID,
    anthropic_field,
    anthropic_image,
    chat_image,
    responses_image,
)
from tests.server.media.pngs import png

MODEL = "fake-model"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png(16, 16))
    settings = ServerSettings(allowed_local_media_path=[str(media)],
                              limit_mm_per_prompt='{"image": 2}')
    with ServerThread(build_app(AsyncEngine(core=FakeCore()), settings)) as srv:
        yield srv, f"file://{media}/cat.png"


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key="x", max_retries=0, timeout=60)


def _openai_refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body


def _anthropic_refusal(call) -> str:
    with pytest.raises(anthropic.BadRequestError) as info:
        call()
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_valid_images_are_refused_by_a_text_only_model(served, oai, claude):
    srv, inside = served
    for url in (VALID, inside):
        err = _openai_refusal(lambda u=url: oai.chat.completions.create(
            model=MODEL, messages=chat_image(u), max_tokens=2))
        assert err["param"] == "messages.0.content.1.image_url.url"
        assert "does not take images (a text-only model)" in err["message"]
        err = _openai_refusal(lambda u=url: oai.responses.create(
            model=MODEL, input=responses_image(u), max_output_tokens=2))
        assert err["param"] == "input.0.content.1.image_url"
        assert "does not take images" in err["message"]
        message = _anthropic_refusal(lambda u=url: claude.messages.create(
            model=MODEL, max_tokens=2, messages=anthropic_image(u)))
        assert message.startswith(anthropic_field(url)) and "does not take images" in message
        message = _anthropic_refusal(lambda u=url: claude.messages.count_tokens(
            model=MODEL, messages=anthropic_image(u)))
        assert "does not take images" in message
    for path in ("/tokenize", "/v1/chat/completions/render"):
        assert_error(httpx.post(f"{srv.url}{path}", json={"messages": chat_image(VALID)},
                                timeout=60), 400, param="messages.0.content.1.image_url.url",
                     contains="does not take images")


@pytest.mark.parametrize("label,url,contains", BAD, ids=[b[0] for b in BAD])
def test_bad_images_get_a_400_naming_the_field(served, oai, claude, label, url, contains):
    err = _openai_refusal(lambda: oai.chat.completions.create(
        model=MODEL, messages=chat_image(url), max_tokens=2))
    assert err["param"] == "messages.0.content.1.image_url.url", label
    assert contains in err["message"] and "does not take images" not in err["message"]
    err = _openai_refusal(lambda: oai.responses.create(
        model=MODEL, input=responses_image(url), max_output_tokens=2))
    assert err["param"] == "input.0.content.1.image_url" and contains in err["message"]
    message = _anthropic_refusal(lambda: claude.messages.create(
        model=MODEL, max_tokens=2, messages=anthropic_image(url)))
    assert message.startswith(anthropic_field(url)) and contains in message


def test_more_images_than_the_limit(served, oai):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": VALID}}] * 3}]
    err = _openai_refusal(lambda: oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2))
    assert "3 images" in err["message"] and "limit of 2" in err["message"]
    assert err["param"] == "messages.0.content.2.image_url.url"


def test_other_part_types_and_file_ids_are_refused(served, oai):
    err = _openai_refusal(lambda: oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "input_audio",
                                      "input_audio": {"data": "AAAA", "format": "wav"}}]}]))
    assert "'input_audio' is not supported" in err["message"]
    err = _openai_refusal(lambda: oai.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]))
    assert err["param"] == "input.0.content.0.file_id" and "Files API" in err["message"]


def test_text_is_still_served(served, oai, claude):
    reply = oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}]).stop_reason in ("max_tokens", "end_turn")
