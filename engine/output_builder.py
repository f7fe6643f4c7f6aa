"""Turning engine state into ``RequestOutput`` objects, and recording logprobs."""

from __future__ import annotations

from collections.abc import Callable

from engine.batch import PromptLogitRows
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, Sequence
from engine.sampler import SamplerOutput, compute_prompt_logprobs
from engine.scheduler import ScheduledSeq


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
    )


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


def record_prompt_logprobs(scheduled: list[ScheduledSeq], rows: list[PromptLogitRows],
                           logits, token_text: Callable[[int], str]) -> None:
    """Append prompt logprobs (position 0 has none: ``None``) for the rows computed this step."""
    for r in rows:
        req = scheduled[r.seq_index].seq.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        n = r.row_end - r.row_start
        targets = req.prompt_token_ids[r.first_target:r.first_target + n]
        req.prompt_logprobs.extend(compute_prompt_logprobs(
            logits[r.row_start:r.row_end], targets, req.params.prompt_logprobs or 0, token_text))
