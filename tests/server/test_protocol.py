"""Request models -> SamplingParams, validation messages, SSE framing, logprob shapes."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from engine.request_output import Logprob
from server.errors import format_validation_errors
from server.logprobs import CompletionLogprobs, chat_logprobs
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sse import DONE, event
from tests.server.fakes import FakeTokenizer
from tests.support.sse_events import parse_events


def _error(model, **body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model(**body)
    return format_validation_errors(info.value.errors())


def test_completion_defaults_follow_openai():
    req = CompletionRequest(prompt="hi")
    p = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n, p.stop) == \
        (16, 1.0, 1.0, -1, 1, [])


def test_completion_fields_map_onto_sampling_params():
    req = CompletionRequest(prompt=[1, 2], temperature=0, top_p=0.5, top_k=3, min_p=0.1, n=2,
                            stop="###", stop_token_ids=[7], seed=11, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2,
                            logit_bias={"5": -100}, ignore_eos=True, min_tokens=2,
                            cache_salt="s", skip_special_tokens=False, unknown_field=1)
    p = req.sampling_params(max_tokens=8, logprobs=2, prompt_logprobs=2)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.n, p.stop, p.stop_token_ids) == \
        (0, 0.5, 3, 0.1, 2, ["###"], [7])
    assert (p.seed, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == \
        (11, 0.5, -0.5, 1.2)
    assert p.logit_bias == {5: -100.0} and p.ignore_eos and p.min_tokens == 2
    assert (p.cache_salt, p.skip_special_tokens, p.logprobs, p.prompt_logprobs) == \
        ("s", False, 2, 2)


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_chat_max_completion_tokens_wins_and_developer_is_system():
    req = ChatCompletionRequest(messages=[{"role": "developer", "content": "d"},
                                          {"role": "user", "content": [
                                              {"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]}],
                                max_tokens=5, max_completion_tokens=9)
    assert req.max_new_tokens == 9
    assert req.conversation() == [{"role": "system", "content": "d"},
                                  {"role": "user", "content": "a\nb"}]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).max_new_tokens \
        is None  # as OpenAI: up to the context length


@pytest.mark.parametrize("body,param,fragment", [
    ({"prompt": "x", "suffix": "s"}, "suffix", "not supported"),
    ({"prompt": ["a", 1]}, "prompt", "list of token ids"),
    ({"prompt": [[1], []]}, None, "empty"),
    ({"prompt": "x", "best_of": 3}, None, "best_of"),
    ({"prompt": "x", "seed": 2**70}, "seed", ""),
    ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids.0", ""),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt", "must not be empty"),
    ({"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "must not be empty"),
    ({"prompt": "x", "stop": ""}, "stop", "must not be empty"),
])
def test_completion_validation_messages(body, param, fragment):
    message, got_param = _error(CompletionRequest, **body)
    assert got_param == param and fragment in message


def test_validation_message_for_json_errors():
    msg, param = format_validation_errors([{"type": "json_invalid", "loc": ("body", 3),
                                            "msg": "JSON decode error",
                                            "ctx": {"error": "Expecting value"}}])
    assert "not valid JSON at character 3" in msg and "Expecting value" in msg
    assert param is None  # a position in the body is not a parameter


def test_sse_event_framing_and_round_trip():
    chunks = [{"a": 1, "t": "ü\n"}, {"b": [1, 2]}]
    body = "".join(event(c) for c in chunks) + DONE
    assert body.startswith('data: {"a":1,"t":"ü\\n"}\n\n')
    assert body.endswith("data: [DONE]\n\n")
    assert parse_events(body) == [*chunks, "[DONE]"]
    assert parse_events(body.replace("\n", "\r\n")) == [*chunks, "[DONE]"]
    with pytest.raises(ValueError):
        event({"x": math.inf})  # never emit invalid JSON


def test_sse_events_hold_no_line_break_of_splitlines():
    """Text holding U+0085, U+2028, U+2029 (and the ASCII controls ``splitlines`` also ends
    lines at) stays on its ``data:`` line for a reader that splits like ``str.splitlines``
    (``httpx``'s ``iter_lines``), and decodes to the same text."""
    text = "a\x85b\u2028c\u2029d\x0be\x0cf\x1cg\x1dh\x1ei\u00e9\u4e2d\U0001F600"
    body = event({"text": text})
    lines = [line for line in body.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"text": text}
    assert "\u00e9\u4e2d" in body  # other text stays UTF-8 as it is


def test_completion_logprobs_with_echo_positions_and_offsets():
    tok = FakeTokenizer()
    positions = [None, {66: Logprob(-1.0, 1, "B"), 67: Logprob(-2.0, 2, "C")},
                 {99: Logprob(-0.25, 3, "c"), 100: Logprob(-0.1, 1, "d"),
                  101: Logprob(-float("inf"), 2, "e")}]
    out = CompletionLogprobs(tok, k=2).build([65, 66, 99], positions)
    assert out["tokens"] == ["A", "B", "c"]
    assert out["token_logprobs"] == [None, -1.0, -0.25]
    assert out["top_logprobs"][0] is None
    assert out["top_logprobs"][1] == {"B": -1.0, "C": -2.0}
    assert out["top_logprobs"][2] == {"d": -0.1, "e": -9999.0, "c": -0.25}  # top 2 + chosen
    assert out["text_offset"] == [0, 1, 2]
    json.dumps(out, allow_nan=False)


def test_chat_logprobs_shape():
    tok = FakeTokenizer()
    out = chat_logprobs(tok, [233], [{233: Logprob(-0.5, 1, "é"), 66: Logprob(-1.5, 2, "B")}],
                        k=2)
    item = out["content"][0]
    assert item["token"] == "é" and item["bytes"] == [0xC3, 0xA9] and item["logprob"] == -0.5
    assert [t["token"] for t in item["top_logprobs"]] == ["é", "B"]
    assert out["refusal"] is None
