"""``POST /v1/completions``: OpenAI's legacy completions, streaming and not.

Choice ``index`` is ``prompt_index * n + sample_index``. With ``echo`` the prompt text (and its
logprobs, when asked for) precedes the completion; in a stream it goes in the choice's first
chunk. Usage counts each prompt once, whatever ``n`` is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.request_output import RequestOutput
from server.errors import bad_request
from server.logprobs import CompletionLogprobs
from server.prompt_bound import check_chars, release_after
from server.protocol import CompletionRequest
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_constraint,
    client_of,
    new_id,
    request_id_of,
    respond,
    stream_events,
    submit_or_error,
    usage_of,
)
from server.sse import event

logger = logging.getLogger("kvserve.server")


def tokenize_prompts(ctx: ServingContext, req: CompletionRequest
                     ) -> list[tuple[str | None, list[int]]]:
    """Each prompt of ``req`` with its token ids (a text prompt tokenised, ids as given)."""
    out: list[tuple[str | None, list[int]]] = []
    prompts = req.prompts()
    for p in prompts:
        if isinstance(p, str):  # refused by its length before any prompt is tokenised
            check_chars(ctx.prompt_bound, len(p), "prompt")
    for p in prompts:
        if isinstance(p, str):
            out.append((p, list(ctx.tokenizer.encode(p, add_special_tokens=req.add_special_tokens))))
            release_after(len(p))
        else:
            out.append((None, list(p)))
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request
                            ) -> Response:
    xrid = request_id_of(raw)
    model = ctx.check_model(req.model)
    ctx.check_limits(num_prompts=len(req.prompts()), n=req.n, priority=req.priority,
                     logprobs=req.logprobs)
    prompts = await asyncio.to_thread(tokenize_prompts, ctx, req)
    try:
        params = req.sampling_params(
            max_tokens=req.max_tokens, logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            defaults=ctx.sampling_defaults)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    await check_constraint(ctx, params, xrid, client_of(raw))
    cid = new_id("cmpl")
    streams = submit_or_error(ctx, prompts, params, cid, req.priority, xrid, model=model)
    with aborted_on_error(streams):
        logger.info("request_id=%s %s: %d prompt(s), %s prompt tokens, n=%d, max_tokens=%s, "
                    "stream=%s", xrid, cid, len(prompts), [len(ids) for _, ids in prompts],
                    req.n, req.max_tokens, bool(req.stream))
        prompt_texts = [text if text is not None or not req.echo else
                        ctx.tokenizer.decode(ids, skip_special_tokens=False)
                        for text, ids in prompts]
        writer = _Writer(ctx, req, cid, model, prompt_texts, xrid)
        return await respond(raw, streams, ctx, xrid,
                             (lambda: writer.stream(raw, streams)) if req.stream else None,
                             writer.response)


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
    logprobs: CompletionLogprobs | None = None


class _Writer:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, cid: str, model: str,
                 prompt_texts: list[str | None], xrid: str) -> None:
        self.ctx, self.req, self.cid, self.model, self.xrid = ctx, req, cid, model, xrid
        self.prompt_texts = prompt_texts
        self.created = int(time.time())

    def _base(self) -> dict[str, Any]:
        return {"id": self.cid, "object": "text_completion", "created": self.created,
                "model": self.model}

    def _echo_logprobs(self, out: RequestOutput) -> tuple[list[int], list[Any]]:
        if not self.req.echo or out.prompt_logprobs is None:
            return [], []
        positions = list(out.prompt_logprobs)
        positions += [None] * (len(out.prompt_token_ids) - len(positions))
        return list(out.prompt_token_ids), positions[:len(out.prompt_token_ids)]

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for pi, out in enumerate(finals):
            for c in out.outputs:
                prefix = (self.prompt_texts[pi] or "") if self.req.echo else ""
                lp = None
                if self.req.logprobs is not None:
                    ids, positions = self._echo_logprobs(out)
                    lp = CompletionLogprobs(self.ctx.tokenizer, self.req.logprobs).build(
                        ids + list(c.token_ids), positions + list(c.logprobs or []))
                choices.append({"index": pi * self.req.n + c.index, "text": prefix + c.text,
                                "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {**self._base(), "choices": choices, "usage": usage_of(finals),
                "system_fingerprint": None}

    def stream(self, raw: Request, streams: list) -> AsyncIterator[str]:
        n = self.req.n
        states = [_ChoiceState() for _ in range(len(streams) * n)]

        def deltas(pi: int, out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                chunk = self._delta(pi, out, c, states[pi * n + c.index])
                if chunk is not None:
                    yield event({**self._base(), "choices": [chunk]})

        def closing(finals: list[RequestOutput]) -> Iterator[str]:
            if self.req.include_usage:
                yield event({**self._base(), "choices": [], "usage": usage_of(finals)})

        def cut_short() -> Iterator[str]:  # the drain's budget ran out: vLLM's "abort"
            for k, st in enumerate(states):
                if not st.finished:
                    st.finished = True
                    yield event({**self._base(), "choices": [{
                        "index": k, "text": "", "logprobs": None, "finish_reason": "abort",
                        "stop_reason": None}]})

        return stream_events(self.ctx, raw, streams, self.xrid, deltas=deltas, closing=closing,
                             cut_short=cut_short)

    def _delta(self, pi: int, out: RequestOutput, c: Any, st: _ChoiceState
               ) -> dict[str, Any] | None:
        if st.finished:
            return None
        text = c.text[st.text_len:]
        new_ids = list(c.token_ids[st.num_tokens:])
        ids: list[int] = []
        positions: list[Any] = []
        if not st.started and self.req.echo:
            text = (self.prompt_texts[pi] or "") + text
            ids, positions = self._echo_logprobs(out)
        if not text and not c.finish_reason and not (self.req.logprobs is not None and new_ids):
            return None  # nothing to say yet (text held back while a stop string may match)
        lp = None
        if self.req.logprobs is not None:
            if st.logprobs is None:
                st.logprobs = CompletionLogprobs(self.ctx.tokenizer, self.req.logprobs)
            lp = st.logprobs.build(ids + new_ids,
                                   positions + list((c.logprobs or [])[st.num_tokens:]))
        st.started = True
        st.text_len = len(c.text)
        st.num_tokens = len(c.token_ids)
        st.finished = c.finish_reason is not None
        return {"index": pi * self.req.n + c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
