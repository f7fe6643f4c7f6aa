"""Turning engine state into ``RequestOutput`` objects, and recording logprobs."""

from __future__ import annotations

from collections.abc import Callable

from engine.request import Request, Sequence
from engine.request_output import CompletionOutput, RequestOutput
from engine.sampling.prompt_logprobs import PromptLogprobs, position_entries
from engine.sampling.sampler import SamplerOutput
from engine.step.output import PromptLogitRows


def build_request_output(req: Request) -> RequestOutput:
    outputs = []
    for seq in req.seqs:
        outputs.append(CompletionOutput(
            index=seq.index,
            text=seq.text_state.text,
            token_ids=list(seq.text_state.token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        ))
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=outputs,
        finished=req.finished,
        num_cached_tokens=req.num_cached_tokens or 0,
        prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        metrics=req.metrics,
        error=req.error,
        error_code=req.error_code,
        pooled=req.pooled,
    )


def bare_error_output(req: Request) -> RequestOutput:
    """The final output of a request whose full output could not be built: every sample
    "abort", no text, ``error`` set (the request must already be finished)."""
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        outputs=[CompletionOutput(index=s.index, finish_reason="abort") for s in req.seqs],
        finished=True, num_cached_tokens=req.num_cached_tokens or 0, metrics=req.metrics,
        error=req.error or "internal error", error_code=req.error_code)


def record_sample_logprobs(seq: Sequence, sampled: SamplerOutput, row: int,
                           token_text: Callable[[int], str]) -> None:
    """Append the chosen token's logprob (+ its top-k alternatives) for one sampled row."""
    if seq.logprobs is None:
        return
    entry = sampled.position_logprobs(row, token_text)
    if entry is None:
        return
    seq.logprobs.append(entry)
    seq.cumulative_logprob += sampled.logprobs[row]


def record_prompt_logprobs(req: Request, rows: PromptLogitRows, reduced: PromptLogprobs,
                           token_text: Callable[[int], str]) -> None:
    """Append the prompt logprobs of ``rows`` (computed this step) to ``req.prompt_logprobs``
    (position 0 has none: ``None``). Rows must continue exactly where the list ends, so an
    entry is never recorded twice nor skipped; anything else raises RuntimeError."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    if rows.first_target != len(req.prompt_logprobs):
        raise RuntimeError(f"prompt logprobs of request {req.request_id} out of order: rows "
                           f"for target {rows.first_target}, {len(req.prompt_logprobs)} recorded")
    n = rows.row_end - rows.row_start
    targets = req.prompt_token_ids[rows.first_target:rows.first_target + n]
    req.prompt_logprobs.extend(position_entries(
        reduced, rows.row_start, rows.row_end, targets, req.params.prompt_logprobs or 0,
        token_text))
