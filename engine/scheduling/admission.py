"""Admission: can a request ever be served? The one place requests are validated. Pure checks,
raising ``ValueError`` with a message a user can act on (the server's 400;
:class:`FieldValueError` when the fault is in a request field other than the prompt, naming
it). What is only momentarily impossible (a full waiting queue) is not decided here: that is
``AsyncEngine.submit``'s ``QueueFullError`` (503).

Who calls what: :func:`check_request` runs once per request, before it is queued
(``EngineCore.add_request``, or ``AsyncEngine.submit`` on the caller's thread, which tells the
core so); the server first runs :func:`check_limits` on the request's fields alone, before any
prompt is tokenised (a cheap early 400 for the same sequence, logprobs and priority limits).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.engine import EngineConfig
from engine.kv_cache.groups import KVGroupLayout
from engine.params.sampling import SamplingParams


class FieldValueError(ValueError):
    """A request that can never be served because of ``field`` (a SamplingParams field named
    as the API names it: ``stop_token_ids``, ``logit_bias``), not because of its prompt."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdmissionLimits:
    """What an engine can hold, fixed at start-up."""

    max_model_len: int
    token_id_bound: int  # ids in [0, bound) are known to the model AND the tokenizer
    block_size: int
    num_blocks: int  # the device KV pool
    swap_blocks: int  # host blocks samples may wait in under swap preemption (0: none)
    # --kv-eviction: the most cached tokens of a decoding sequence (None: eviction off; then
    # a sequence's text must fit max_model_len)
    max_cache_tokens: int | None = None
    # Hybrid KV cache (engine.kv_cache.groups.KVGroupLayout): blocks a sequence holds at most
    # across its groups; None: one group, ceil(tokens / block_size)
    kv_layout: KVGroupLayout | None = None


def check_request(config: EngineConfig, limits: AdmissionLimits, prompt_token_ids: list[int],
                  params: SamplingParams, priority: int = 0) -> None:
    """Raise ValueError if this request can never be served: priority under fcfs, too many
    samples (:func:`check_num_seqs`), an empty prompt, a token id the tokenizer does not
    know (prompt, ``logit_bias``, ``stop_token_ids``), beyond the context length, more KV
    than the pool holds, more logprobs than ``max_logprobs``."""
    check_priority(config, priority)
    check_num_seqs(config, params.n)
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    _check_ids(limits, "the prompt", prompt_token_ids)
    max_len = limits.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
    if n + max_tokens > max_len and not (limits.max_cache_tokens and n < max_len):
        # (under streaming eviction only the prompt, and one token after it, must fit)
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the prompt or max_tokens.")
    if max_tokens < 1:
        raise ValueError(f"the prompt ({n} tokens) leaves no room to generate within the "
                         f"maximum context length of {max_len} tokens")
    _check_fits_pool(limits, n, max_tokens, params.n)
    check_logprobs(config, params.logprobs)
    check_logprobs(config, params.prompt_logprobs, "prompt_logprobs")
    if params.logit_bias:
        bound = limits.token_id_bound
        bad = next((t for t in params.logit_bias if not 0 <= t < bound), None)
        if bad is not None:
            raise FieldValueError("logit_bias", f"logit_bias names token {bad}, outside the "
                                  f"vocabulary (0..{bound - 1})")
    _check_ids(limits, "stop_token_ids", params.stop_token_ids)


def check_limits(config: EngineConfig, *, num_prompts: int, n: int, priority: int,
                 logprobs: int | None = None, logprobs_param: str = "logprobs") -> None:
    """Raise :class:`FieldValueError` (naming the field: ``logprobs_param``, ``n``, ``prompt``
    for a batch of prompts, ``priority``) for request fields no retry can serve: more logprobs
    than ``max_logprobs``, more sequences (``num_prompts x n``) than one request may have or
    than the whole waiting queue holds, a non-zero ``priority`` under fcfs. Cheap: for the
    server, before any prompt is tokenised."""
    try:
        check_logprobs(config, logprobs, logprobs_param)
    except ValueError as exc:
        raise FieldValueError(logprobs_param, str(exc)) from None
    seqs = num_prompts * n
    what = (f"{num_prompts} prompts x n={n} = {seqs} sequences" if num_prompts > 1
            else f"n={n} sequences")
    try:
        check_num_seqs(config, seqs, what)
    except ValueError as exc:
        raise FieldValueError("prompt" if num_prompts > 1 else "n", str(exc)) from None
    try:
        check_priority(config, priority)
    except ValueError as exc:
        raise FieldValueError("priority", str(exc)) from None


def check_num_seqs(config: EngineConfig, num_seqs: int, what: str | None = None) -> None:
    """Raise ValueError (a 400: retrying cannot help) when one request of ``num_seqs``
    sequences could never be admitted: above ``config.seqs_per_request_cap``, or above
    ``max_waiting_requests`` (the whole waiting queue). ``what`` describes the request in
    the message (default ``"<num_seqs> sequences (n x prompts)"``)."""
    what = what or f"{num_seqs} sequences (n x prompts)"
    cap = config.seqs_per_request_cap
    if num_seqs > cap:
        raise ValueError(f"this request asks for {what}, but at most {cap} are allowed per "
                         f"request (--max-seqs-per-request / max_seqs_per_request, default "
                         f"--max-num-seqs); lower n or send fewer prompts at once")
    if num_seqs > config.max_waiting_requests:
        raise ValueError(f"this request asks for {what}, but the waiting queue holds at "
                         f"most {config.max_waiting_requests} (--max-waiting-requests / "
                         f"max_waiting_requests); lower n or send fewer prompts at once")


def check_logprobs(config: EngineConfig, k: int | None, name: str = "logprobs") -> None:
    """Raise ValueError when ``k`` (sample or prompt logprobs per token) is above
    ``max_logprobs``."""
    if k is not None and k > config.max_logprobs:
        raise ValueError(f"{name} must be at most {config.max_logprobs}; got {k}")


def check_priority(config: EngineConfig, priority: int) -> None:
    """Raise ValueError for a non-zero ``priority`` unless ``scheduling_policy`` is
    ``"priority"``."""
    if priority != 0 and config.scheduling_policy != "priority":
        raise ValueError(f"priority {priority} is not allowed: this server schedules first "
                         f"come, first served (priority scheduling is off; start the server "
                         f"with --scheduling-policy priority to honour request priorities)")


def _check_ids(limits: AdmissionLimits, where: str, ids: list[int]) -> None:
    bound = limits.token_id_bound
    bad = next((t for t in ids if not 0 <= t < bound), None)
    if bad is not None:
        message = f"token id {bad} in {where} is outside the vocabulary (0..{bound - 1})"
        raise ValueError(message) if where == "the prompt" else FieldValueError(where, message)


def _check_fits_pool(limits: AdmissionLimits, prompt_len: int, max_tokens: int, n: int) -> None:
    """One sample must fit the device pool, and all ``n`` samples at full length must fit at
    once, even with nothing else running: sample 1 holds ``ceil(T / bs)`` blocks (T = prompt
    + max_tokens), each other sample the same minus the prompt's full blocks it shares (the
    last prompt token is always its own). Under swap preemption the host tier counts too:
    samples wait there while another runs. (With recompute such a request could only finish
    by preempting its own samples over and over: refused.)"""
    bs, num_blocks = limits.block_size, limits.num_blocks
    total = prompt_len + max_tokens
    shared = (prompt_len - 1) // bs  # prompt blocks samples 2..n share with sample 1
    if limits.max_cache_tokens is not None:  # the cache stops growing; no block sharing
        total = min(total, max(prompt_len, limits.max_cache_tokens))
        shared = 0
    layout = limits.kv_layout
    if layout is not None:  # hybrid: per-group blocks, samples share nothing
        fits = layout.max_seq_tokens(num_blocks, bs)
        if layout.blocks_for(total, bs) > num_blocks:
            raise ValueError(f"the request needs {total} tokens of KV cache but the whole pool "
                             f"holds {fits}; raise kv_cache_memory or shorten it")
        per_seq, shared = layout.blocks_for(total, bs), 0
    elif total > num_blocks * bs:
        raise ValueError(f"the request needs {total} tokens of KV cache but the whole pool "
                         f"holds {num_blocks * bs}; raise kv_cache_memory or shorten it")
    else:
        per_seq = -(-total // bs)
    need = per_seq + (n - 1) * (per_seq - shared)
    capacity = num_blocks + limits.swap_blocks
    if need > capacity:
        raise ValueError(f"the request's {n} samples need {need} KV blocks of {bs} tokens at "
                         f"full length ({prompt_len} prompt tokens, shared, and up to "
                         f"{max_tokens} generated each) but the whole pool holds {capacity}; "
                         f"lower n or max_tokens, or raise kv_cache_memory")
