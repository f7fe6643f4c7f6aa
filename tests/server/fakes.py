"""A stand-in for EngineCore with EngineCore's interface and deterministic behaviour, to test
the server's plumbing (errors, aborts, queue bounds, engine death) quickly and exactly.

Tokens are characters: token id = code point. Each step every running sequence emits the next
character of ``script`` ("abcdefghijklmnopqrstuvwxyz" unless a test sets another; cycling)
until max_tokens; a stop string ends it early with "stop". Constraints are recorded
(``structured.specs``), never applied. ``pause()`` / ``allow(k)`` / ``resume()`` let a test hold the engine inside
``step`` (after ``k`` more steps), so that what happens meanwhile is deterministic. A prompt
holding ``FAIL_PROMPT`` ends its request, at its first step, with ``RequestOutput.error``
set (as EngineCore does when its per-request work raises); the engine goes on.
"""

from __future__ import annotations

import string
import threading
import time
from dataclasses import dataclass, field

from engine.config.engine import EngineConfig
from engine.loading.generation_defaults import GenerationDefaults
from engine.params.sampling import SamplingParams
from engine.request_output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.scheduling.admission import check_num_seqs, check_priority
from engine.stats import EngineStats

VOCAB = 0x250
FAIL_PROMPT = "!ERR"


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True,
                            **kwargs) -> str:
        if any(m["role"] == "assistant" for m in conversation[:1]):
            raise ValueError("Conversation roles must start with system or user")
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __len__(self) -> int:
        return VOCAB


class FakeGrammars:
    """Stands in for the engine's grammar cache: records each constraint compiled."""

    def __init__(self) -> None:
        self.specs: list = []

    def compile(self, spec, timeout=None, client="") -> None:
        self.specs.append(spec)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    outs: list[CompletionOutput] = field(default_factory=list)
    fail: bool = False  # the prompt holds FAIL_PROMPT


class FakeCore:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 4, step_delay: float = 0.0,
                 **config) -> None:
        self.config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   **config)
        self.tokenizer = FakeTokenizer()
        self.script = string.ascii_lowercase
        self.structured = FakeGrammars()
        self.model_name = "fake-model"
        self.generation_defaults = GenerationDefaults()  # OpenAI's defaults
        self.pooling = None  # a generative model: no embeddings (engine.pooling.serving)
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB
        self.token_id_bound = VOCAB
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.step_delay = step_delay
        self._budget: int | None = None  # steps allowed before blocking; None = unlimited
        self._cond = threading.Condition()
        self.idle_checks = 0  # has_unfinished_requests() calls: shows the loop sleeps when idle
        self.fail_next_step: BaseException | None = None
        self.steps = 0
        self.blocks_used = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                      priority: int = 0, images: tuple = ()) -> None:
        if images:
            raise ValueError("the fake model does not take images")
        check_priority(self.config, priority)
        check_num_seqs(self.config, params.n)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < VOCAB for t in prompt_token_ids):
            raise ValueError("token id outside the vocabulary")
        max_tokens = params.max_tokens if params.max_tokens is not None else \
            self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, you requested {n + max_tokens} tokens ({n} in the "
                             f"prompt, {max_tokens} for the completion).")

    def add_request(self, request_id, prompt_token_ids, params, *, prompt=None,
                    arrival_time=None, priority=0, validated=False, images=()) -> None:
        if not validated:
            self.check_request(prompt_token_ids, params, images=images)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(prompt_token_ids))
        req = _Req(request_id, list(prompt_token_ids), params,
                   RequestMetrics(arrival_time or time.time()))
        req.fail = FAIL_PROMPT in "".join(map(chr, req.prompt))
        req.outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None
                                     else None) for i in range(params.n)]
        self.requests[request_id] = req
        self.blocks_used += 1
        self.prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_ids) -> None:
        for rid in list(request_ids):
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)
                self.blocks_used -= 1

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.requests)

    def pause(self) -> None:
        self.allow(0)

    def allow(self, steps: int) -> None:
        with self._cond:
            self._budget = steps
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def step(self) -> list[RequestOutput]:
        with self._cond:
            while self._budget == 0:
                self._cond.wait()
            if self._budget is not None:
                self._budget -= 1
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        if self.fail_next_step is not None:
            raise self.fail_next_step
        now = time.time()
        outputs = []
        for rid, req in list(self.requests.items())[:self.config.max_num_seqs]:
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            if req.fail:
                del self.requests[rid]
                self.blocks_used -= 1
                outputs.append(RequestOutput(
                    request_id=rid, prompt=None, prompt_token_ids=req.prompt,
                    outputs=[CompletionOutput(c.index, finish_reason="abort") for c in req.outs],
                    finished=True, metrics=req.metrics, error="ValueError: secret internals"))
                continue
            for c in req.outs:
                if c.finish_reason:
                    continue
                tok = ord(self.script[len(c.token_ids) % len(self.script)])
                c.token_ids = [*c.token_ids, tok]
                c.text += chr(tok)
                self.generation_tokens += 1
                if c.logprobs is not None:
                    k = req.params.logprobs or 0
                    alts = {tok + 1 + j: Logprob(-2.0 - j, 2 + j, chr(tok + 1 + j))
                            for j in range(k)}
                    c.logprobs = [*c.logprobs, {tok: Logprob(-0.5, 1, chr(tok)), **alts}]
                hit = next((s for s in req.params.stop if s in c.text), None)
                if hit is not None:
                    c.text = c.text[:c.text.index(hit)]
                    c.finish_reason, c.stop_reason = "stop", hit
                elif len(c.token_ids) >= req.params.max_tokens:
                    c.finish_reason = "length"
            req.metrics.first_token_time = req.metrics.first_token_time or now
            finished = all(c.finish_reason for c in req.outs)
            if finished:
                req.metrics.finished_time = now
                del self.requests[rid]
                self.blocks_used -= 1
            outputs.append(RequestOutput(
                request_id=rid, prompt=None, prompt_token_ids=req.prompt,
                outputs=[CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                                          c.stop_reason, list(c.logprobs) if c.logprobs
                                          is not None else None) for c in req.outs],
                finished=finished, metrics=req.metrics))
        return outputs

    def stats(self) -> EngineStats:
        running = min(len(self.requests), self.config.max_num_seqs)
        return EngineStats(
            num_requests_running=running, num_requests_waiting=len(self.requests) - running,
            num_seqs_waiting=len(self.requests) - running,
            kv_cache_usage_perc=self.blocks_used / 100, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, num_blocks_total=100,
            num_blocks_free=100 - self.blocks_used, num_blocks_used=self.blocks_used,
            kv_bytes_per_token=64, num_steps=self.steps,
            computed_tokens=self.prompt_tokens + self.generation_tokens)
