"""End to end with the real server (the session's ``real_server``: the embedded text model) and
the real ``openai`` and ``anthropic`` SDKs: a valid PNG data URL gets the 400 "does not take
images" with the image's field as ``param``; a truncated PNG, random bytes, a 20000x20000
header, a disallowed http URL and a file:// URL (no directory is allowed) each a 400 naming the
field, never a 500; a text request is served afterwards."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.media.cases import (
    BAD,
    VALID,
    anthropic_field,
    anthropic_image,
    chat_image,
    responses_image,
)
from tests.support.real_server import API_KEY

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"


def _bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def test_images_are_refused_naming_the_field_and_text_is_still_served(real_server):
    oai = real_server.client()
    claude = anthropic.Anthropic(base_url=real_server.url, api_key=API_KEY, max_retries=0,
                                 timeout=300)
    err = _bad_request(lambda: oai.chat.completions.create(
        model=MODEL, messages=chat_image(VALID), max_tokens=4)).body
    assert err["param"] == "messages.0.content.1.image_url.url"
    assert f"model {MODEL} does not take images (a text-only model)" in err["message"]
    err = _bad_request(lambda: oai.responses.create(
        model=MODEL, input=responses_image(VALID), max_output_tokens=4)).body
    assert err["param"] == "input.0.content.1.image_url"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=4, messages=anthropic_image(VALID))
    assert info.value.body["error"]["message"].startswith(anthropic_field(VALID))
    assert "does not take images" in info.value.body["error"]["message"]
    for label, url, contains in BAD:
        err = _bad_request(lambda u=url: oai.chat.completions.create(
            model=MODEL, messages=chat_image(u), max_tokens=4)).body
        assert err["param"] == "messages.0.content.1.image_url.url", label
        assert contains in err["message"], (label, err)
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=MODEL, max_tokens=4, messages=anthropic_image(url))
        assert contains in info.value.body["error"]["message"], label
    reply = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}])
    assert reply.choices[0].message.content is not None
    assert "Traceback" not in real_server.log()
