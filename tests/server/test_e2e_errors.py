"""End to end with the real engine: error answers while a long stream is in flight, a client
disconnect that gives its KV blocks back (read from /metrics), /metrics counters against the
requests sent, the API key, and X-Request-Id in the log."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.helpers import assert_error, sample, scrape
from tests.support.sse_events import parse_events

pytestmark = pytest.mark.slow

LONG = 64  # tokens of the stream kept in flight (ignore_eos: it runs to the end)


def _wait_until(pred, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_errors_while_a_long_stream_is_in_flight(real_server):
    url, h = real_server.url, real_server.headers
    result: dict = {"chunks": 0}
    first_chunk = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", headers=h, timeout=600, json={
                "prompt": "Count: 1, 2, 3,", "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            chunks = []
            for line in r.iter_lines():
                chunks.append(line)
                if '"text"' in line:
                    result["chunks"] += 1
                    first_chunk.set()
            result["body"] = "\n".join(chunks) + "\n"

    t = threading.Thread(target=long_stream)
    t.start()
    assert first_chunk.wait(300)
    post = lambda path, body, **kw: httpx.post(f"{url}{path}", json=body,  # noqa: E731
                                               headers=kw.get("headers", h), timeout=60)
    assert_error(post("/v1/completions", {"prompt": "x", "max_tokens": 1024}), 400,
                 contains="maximum context length is 1024")
    err = assert_error(post("/v1/completions", {"prompt": "x " * 600, "max_tokens": 500}), 400)
    assert "1024" in err["message"] and "500" in err["message"]
    assert_error(post("/v1/completions", {"prompt": [49152]}), 400, contains="vocabulary")
    assert_error(post("/v1/completions", {"prompt": "x", "logit_bias": {"60000": 5}}), 400,
                 contains="vocabulary")
    assert_error(post("/v1/completions", {"prompt": "x", "temperature": "hot"}), 400,
                 param="temperature")
    assert_error(post("/v1/completions", {"prompt": "x", "suffix": "y"}), 400, param="suffix")
    assert_error(post("/v1/completions", {"prompt": "x", "model": "gpt-4o"}), 404,
                 code="model_not_found")
    assert_error(post("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        400, param="messages.0.content.0.image_url.url", contains="data: URL")
    assert_error(post("/v1/completions", {"prompt": "x"}, headers={}), 401,
                 code="invalid_api_key")
    assert_error(post("/v1/completions", {"prompt": "x"},
                      headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200  # open without the key
    chunks_during_errors = result["chunks"]
    t.join(600)
    events = parse_events(result["body"])
    assert events[-1] == "[DONE]"
    text_chunks = [e for e in events[:-1] if e.get("choices")]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "error" not in events[-2]
    # The stream was still producing after every error had been answered.
    assert chunks_during_errors < len(text_chunks)


def test_metrics_counters_match_the_requests_sent(real_server):
    client = real_server.client()
    before = scrape(real_server.url)
    usages = []
    for prompt in ("Hello", "The sky is", "1 2 3"):
        r = client.completions.create(model="smol-e2e", prompt=prompt, max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
    chat = client.chat.completions.create(model="smol-e2e", max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    usages.append(chat.usage)
    after = scrape(real_server.url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("kvserve:request_success_total", finished_reason="length") == 4
    assert delta("kvserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvserve:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"kvserve:{hist}_count") == 4
    assert delta("kvserve:inter_token_latency_seconds_count") == 4 * 2  # 3 tokens: 2 gaps
    assert delta("kvserve:prefix_cache_queries_total") >= 0
    assert sample(after, "kvserve:num_requests_running") == 0
    assert 0 <= sample(after, "kvserve:kv_cache_usage_perc") <= 1
    for (name, labels), _ in after.items():
        if name.startswith("kvserve:"):
            assert dict(labels).get("model_name") == "smol-e2e", name


def test_disconnect_gives_the_blocks_back(real_server):
    url = real_server.url
    before = scrape(url)
    with httpx.Client(timeout=600) as client, client.stream(
            "POST", f"{url}/v1/completions", headers=real_server.headers, json={
                "prompt": "Write a long story about a cat.", "max_tokens": 600,
                "ignore_eos": True, "stream": True}) as r:
        # Hold the line iterator: dropping a half-read httpx iterator closes the connection,
        # which would abort the request before the scrape below.
        lines = r.iter_lines()
        seen = 0
        while seen < 2:
            seen += '"text"' in next(lines)
        during = scrape(url)
        assert sample(during, "kvserve:kv_cache_used_blocks") > 0
        assert sample(during, "kvserve:num_requests_running") == 1
    # The connection is closed: the server notices, aborts, and the engine frees the blocks.
    _wait_until(lambda: sample(scrape(url), "kvserve:request_success_total",
                               finished_reason="abort") ==
                sample(before, "kvserve:request_success_total", finished_reason="abort") + 1)
    after = scrape(url)
    assert sample(after, "kvserve:kv_cache_used_blocks") == 0
    assert sample(after, "kvserve:kv_cache_free_blocks") == sample(after,
                                                                   "kvserve:kv_cache_num_blocks")
    assert sample(after, "kvserve:num_requests_running") == 0
    generated = sample(after, "kvserve:generation_tokens_total") - \
        sample(before, "kvserve:generation_tokens_total")
    assert generated < 600


def test_request_id_is_logged(real_server):
    r = httpx.get(f"{real_server.url}/v1/models", headers={**real_server.headers,
                                                           "X-Request-Id": "trace-e2e-42"})
    assert r.headers["x-request-id"] == "trace-e2e-42"
    _wait_until(lambda: "request_id=trace-e2e-42" in real_server.log(), timeout=30)
