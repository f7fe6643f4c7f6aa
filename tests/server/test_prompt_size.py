"""Huge text prompts against the real server (issue 27 item 2): a prompt longer than
``max_model_len`` times the tokenizer's longest token is a 400 before it is tokenised (an 8 MiB
one took 12 s to tokenise and kept +0.7 GB resident), the tightest prompt that fits is still
served, and twenty huge prompts leave the server's resident memory where it was, as do twenty
prompts just within the bound, which are tokenised (glibc kept the tokeniser's peak buffers in
each worker thread's arena: +60-130 MB; server/prompt_bound.py hands them back)."""

from __future__ import annotations

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.helpers import assert_error, start_server_process

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024  # tests/support/real_server.py FLAGS
LONGEST = "\n" + " " * 80  # SmolLM2's longest token: 81 characters


def _huge_text(chars: int = 8 * 2**20) -> str:
    """Ordinary words and punctuation (about 2.5 characters per token)."""
    rnd = random.Random(0)
    words = ["alpha", "beta,", "gamma.", "12", "x", "(y)", "zeta;", "eta", "--", "\n"]
    return " ".join(rnd.choice(words) for _ in range(chars // 4))[:chars]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=300)


def test_a_prompt_beyond_what_could_fit_is_refused_before_tokenising(real_server):
    text = _huge_text()
    err = assert_error(_post(real_server, "/v1/completions", {"prompt": text, "max_tokens": 1}),
                       400, param="prompt", code="context_length_exceeded",
                       contains=f"{len(text)} characters")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert_error(_post(real_server, "/v1/completions", {"prompt": ["hi", text]}), 400,
                 param="prompt", code="context_length_exceeded")
    assert_error(_post(real_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": 1}), 400,
        param="messages", code="context_length_exceeded", contains="characters")
    assert_error(_post(real_server, "/v1/responses", {"input": text}), 400,
                 code="context_length_exceeded")


def test_the_tightest_prompt_that_fits_is_served(real_server):
    # 1023 of the longest token (81 characters each) and one token to generate: exactly the
    # context, and as many characters as fit in it.
    text = LONGEST * (MAX_MODEL_LEN - 1)
    r = _post(real_server, "/v1/completions", {"prompt": text, "max_tokens": 1,
                                                "add_special_tokens": False})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    # One token more is the engine's own refusal, by its token count.
    assert_error(_post(real_server, "/v1/completions", {
        "prompt": LONGEST * MAX_MODEL_LEN, "max_tokens": 1, "add_special_tokens": False}),
        400, param="prompt", contains=f"({MAX_MODEL_LEN} in the prompt")


def test_twenty_huge_prompts_leave_resident_memory_where_it_was(real_server):
    text = _huge_text()
    bodies = [("/v1/completions", {"prompt": text, "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})]
    for path, body in bodies:  # warm-up: first-use allocations are not growth
        assert _post(real_server, path, body).status_code == 400
    before = _rss_mb(real_server.proc.pid)
    for i in range(20):
        path, body = bodies[i % 2]
        assert _post(real_server, path, body).status_code == 400
    growth = _rss_mb(real_server.proc.pid) - before
    assert growth <= 50, f"resident memory grew by {growth:.0f} MB over 20 huge prompts"


def test_twenty_prompts_tokenised_just_within_the_bound_leave_memory_where_it_was(tmp_path):
    # A server of the model's own context (8192 tokens: a bound of 663,552 characters), so that
    # prompts of 600,000 characters (245,000 tokens) are tokenised before the engine refuses them.
    proc, url = start_server_process(
        ["-m", "server.cli", "serve", "--max-model-len", "8192", "--kv-cache-memory", "64MiB"],
        tmp_path / "server.log", timeout=600)
    try:
        text = _huge_text(600_000)

        def post(i: int) -> int:
            path, body = [("/v1/completions", {"prompt": text, "max_tokens": 1}),
                          ("/v1/chat/completions", {"messages": [
                              {"role": "user", "content": text}], "max_tokens": 1})][i % 2]
            r = httpx.post(f"{url}{path}", json=body, timeout=300)
            assert "in the prompt" in r.text  # tokenised: the engine's refusal, by tokens
            return r.status_code

        with ThreadPoolExecutor(4) as pool:  # several tokeniser threads, several arenas
            # Warm-up: both endpoints at the same concurrency, so that first-use allocations
            # (the chat template's compile, each worker thread's malloc arena) are made before
            # the measurement. Then equal rounds: a leak grows memory in every round, while
            # glibc's arenas reaching a new high-water mark lands in some rounds and not others
            # (a single round after a warm-up of 8 still saw 59-61 MB of it on CI's machine,
            # 2026-12-03; two rounds in a row 38.6 and 36.8 MB in a full suite run on a busy
            # 2-core machine, 2026-12-04). So the smallest of three rounds' growths is held to
            # the bound: 2.5 MB per prompt, where keeping a refused prompt's text (0.6 MB) and
            # its 245,000 token ids (~9 MB as a Python list) would cost ~10 MB.
            assert set(pool.map(post, range(8))) == {400}
            rss = [_rss_mb(proc.pid)]
            for _ in range(3):
                assert set(pool.map(post, range(12))) == {400}
                rss.append(_rss_mb(proc.pid))
        growths = [b - a for a, b in zip(rss, rss[1:])]
        assert min(growths) <= 30, f"resident memory grew by {growths} MB in three rounds of 12"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            proc.wait()
