"""Turning engine state into ``RequestOutput`` objects, and recording logprobs."""

from __future__ import annotations

from engine.batch import PromptLogitRows
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.request import Request, Sequence
from engine.sampler import SamplerOutput, compute_prompt_logprobs
from engine.scheduler import ScheduledSeq


def build_request_output(req: Request) -> RequestOutput:
    outputs = []
    for seq in req.seqs:
        outputs.append(CompletionOutput(
            index=seq.index,
            text=seq.text_state.text,
            token_ids=list(seq.output_token_ids),
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


def _decode(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def record_sample_logprobs(seq: Sequence, sampled: SamplerOutput, row: int, tokenizer) -> None:
    """Append the chosen token's logprob (+ top-k alternatives) for one sampled row."""
    if seq.logprobs is None or sampled.logprobs is None:
        return
    token = sampled.token_ids[row]
    lp = sampled.logprobs[row]
    entry: PositionLogprobs = {}
    for rank, (tok, val) in enumerate(sampled.top_logprobs[row] if sampled.top_logprobs else [],
                                      start=1):
        entry[tok] = Logprob(val, rank, _decode(tokenizer, tok))
    chosen = Logprob(lp, sampled.ranks[row] if sampled.ranks else None, _decode(tokenizer, token))
    # The chosen token first, then the alternatives (OpenAI's order for logprobs.top_logprobs).
    seq.logprobs.append({token: chosen, **{t: v for t, v in entry.items() if t != token}})
    seq.cumulative_logprob += lp


def record_prompt_logprobs(scheduled: list[ScheduledSeq], rows: list[PromptLogitRows],
                           logits, tokenizer) -> None:
    for r in rows:
        seq = scheduled[r.seq_index].seq
        req = seq.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        n = r.row_end - r.row_start
        targets = req.prompt_token_ids[r.first_target:r.first_target + n]
        entries = compute_prompt_logprobs(logits[r.row_start:r.row_end], targets,
                                          req.params.prompt_logprobs or 0)
        for entry in entries:
            for tok, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = _decode(tokenizer, tok)
        req.prompt_logprobs.extend(entries)
