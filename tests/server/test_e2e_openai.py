"""End to end: the real server (subprocess, embedded model) driven by the official OpenAI SDK.

Truths checked: the SDK parses every response and chunk; streaming and non-streaming agree
token for token under greedy decoding; usage agrees with /tokenize and the tokens returned;
stop strings cut the greedy text exactly where they first occur; a seed reproduces a sample;
greedy logprobs name the most likely token; the config file + flags reach the running server.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import sample, scrape
from tests.support.real_server import KV_CACHE_BYTES

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def _count(server, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=server.headers)
    return r.json()["count"]


def test_config_file_and_flags_reach_the_running_server(real_server):
    models = real_server.client().models.list()
    [model] = models.data
    assert model.id == "smol-e2e"  # from the file
    assert model.model_extra["max_model_len"] == 1024  # the flag overrode the file's 4096
    m = scrape(real_server.url)
    per_token = sample(m, "kvserve:kv_cache_bytes_per_token")
    assert sample(m, "kvserve:kv_cache_num_blocks") == KV_CACHE_BYTES // (16 * per_token)
    log = real_server.log()
    assert "KV cache" in log and "max concurrency" in log  # kvserve loggers reach the log


def test_completion_stream_equals_non_stream_and_usage_is_consistent(real_server):
    client = real_server.client()
    full = client.completions.create(model="smol-e2e", prompt=PROMPT, **GREEDY)
    choice = full.choices[0]
    assert full.id.startswith("cmpl-") and choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == _count(real_server, PROMPT)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == GREEDY["max_tokens"]
    chunks = list(client.completions.create(model="smol-e2e", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    # The same prompt again: its full blocks now come from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_n2_seed_reproducibility_and_ignore_eos(real_server):
    client = real_server.client()
    kw = {"model": "smol-e2e", "prompt": "Once upon a time", "max_tokens": 6, "n": 2,
          "temperature": 1.0, "seed": 1234, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 12


def test_logprobs_and_echo(real_server):
    client = real_server.client()
    r = client.completions.create(model="smol-e2e", prompt=PROMPT, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy = most likely
    echo = client.completions.create(model="smol-e2e", prompt=PROMPT, echo=True, logprobs=1,
                                     **GREEDY)
    assert echo.choices[0].text == PROMPT + r.choices[0].text
    elp = echo.choices[0].logprobs
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v <= 0 for v in elp.token_logprobs[1:])


def test_stop_string_cuts_where_it_first_occurs(real_server):
    client = real_server.client()
    base = client.completions.create(model="smol-e2e", prompt=PROMPT, temperature=0,
                                     max_tokens=12, extra_body={"ignore_eos": True}).choices[0]
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short to pick a stop string from: {text!r}"
    cut = client.completions.create(model="smol-e2e", prompt=PROMPT, temperature=0,
                                    max_tokens=12, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.finish_reason == "stop"


def test_chat_stream_equals_non_stream(real_server):
    client = real_server.client()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a fruit."}]
    # Distinct cache salts: both requests prefill the whole prompt, so the comparison is of
    # streaming vs not. (A prefix-cache hit computes the prompt's tail through other kernels;
    # with the packed int8-activation kernels that float-rounding difference can flip a
    # near-tie, here "no matter" vs "but a" at the 7th token: see README, quantised weights.)
    full = client.chat.completions.create(model="smol-e2e", messages=messages, temperature=0,
                                          max_completion_tokens=8,
                                          extra_body={"cache_salt": "non-stream"})
    assert full.id.startswith("chatcmpl-") and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model="smol-e2e", messages=messages, temperature=0, max_completion_tokens=8,
        stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "stream"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    tok = httpx.post(f"{real_server.url}/tokenize", headers=real_server.headers,
                     json={"messages": messages}).json()
    assert tok["count"] == full.usage.prompt_tokens


def test_chat_logprobs(real_server):
    r = real_server.client().chat.completions.create(
        model="smol-e2e", messages=[{"role": "user", "content": "Say hi"}], temperature=0,
        max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token or item.bytes


def test_tokenize_detokenize_round_trip(real_server):
    text = "Paged attention, ünïcode and 123."
    ids = httpx.post(f"{real_server.url}/tokenize", headers=real_server.headers,
                     json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = httpx.post(f"{real_server.url}/detokenize", headers=real_server.headers,
                      json={"tokens": ids}).json()["prompt"]
    assert back == text
    # token-id prompts are accepted as such
    r = real_server.client().completions.create(model="smol-e2e", prompt=ids, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids)


def test_concurrent_streams_each_get_their_own_output(real_server):
    """Four streams at once, each forced by logit_bias onto its own token: any cross-talk
    between the per-request output streams would show up as a foreign token."""
    from concurrent.futures import ThreadPoolExecutor

    letters = ["A", "B", "C", "D"]
    ids = {x: httpx.post(f"{real_server.url}/tokenize", headers=real_server.headers,
                         json={"prompt": x, "add_special_tokens": False}).json()["tokens"]
           for x in letters}
    assert all(len(v) == 1 for v in ids.values())

    def run(letter: str) -> tuple[str, str | None]:
        stream = real_server.client().completions.create(
            model="smol-e2e", prompt=f"Say {letter}:", max_tokens=6, stream=True,
            logit_bias={str(ids[letter][0]): 100}, extra_body={"ignore_eos": True})
        text, reason = "", None
        for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(len(letters)) as pool:
        results = list(pool.map(run, letters))
    assert results == [(x * 6, "length") for x in letters]
