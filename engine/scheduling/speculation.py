"""The scheduler's share of speculative decoding: who gets a draft this step, and how long.

Policy (``Scheduler.schedule`` calls these; the proposer is ``engine.spec_decode``'s): only
sequences in the decode phase speculate (every token but the last sampled one computed, at
least one generated); a step speculates only while the decoding sequences number at most
``disable_by_batch_size`` (``SpeculativeConfig.speculates_at``); a draft never runs past
``max_tokens`` (at most ``max_tokens - generated - 1`` drafts) nor the step's token budget, and
never makes the pool preempt anyone (cut to nothing unless its extra blocks leave one free block
per running sequence: ``fit_draft``); a constrained sequence's draft is cut to the prefix its
grammar allows (``engine.structured.draft_masks``).

Jump-forward: a constrained sequence with no draft, in a state where its grammar forces text,
gets that text's tokens as its own history spelled them or else as the tokenizer does
(``engine.structured.jump_forward``), under the same rules, in steps where at most
``jump_forward_max_seqs`` sequences decode."""

from __future__ import annotations

from engine.config.speculative import SpeculativeConfig
from engine.request import Sequence
from engine.spec_decode.proposer import DraftRequest, Proposer
from engine.structured.draft_masks import grammar_prefix
from engine.structured.jump_forward import JumpForward


def in_decode_phase(seq: Sequence) -> bool:
    return (seq.num_tokens - seq.num_computed_tokens == 1
            and seq.num_computed_tokens >= seq.num_prompt_tokens)


def _room(seq: Sequence) -> int:
    """Draft tokens ``seq`` may take before its ``max_tokens`` (its own token comes too)."""
    return (seq.request.params.max_tokens or 0) - (seq.num_tokens - seq.num_prompt_tokens) - 1


def propose_drafts(running: list[Sequence], proposer: Proposer,
                   config: SpeculativeConfig) -> dict[str, list[int]]:
    """Drafts of the running sequences that may speculate this step, by ``seq_id`` (empty
    when the adaptive switch is off for this many decoding sequences)."""
    decoding = [s for s in running if in_decode_phase(s)]
    if not decoding or not config.speculates_at(len(decoding)):
        return {}
    batch = []
    seqs = []
    for seq in decoding:
        room = min(config.num_speculative_tokens, _room(seq))
        if room >= 1:
            batch.append(DraftRequest(seq.seq_id, seq.token_ids, room))
            seqs.append(seq)
    if not batch:
        return {}
    drafts = proposer.propose(batch)
    out = {}
    for r, seq, d in zip(batch, seqs, drafts, strict=True):
        d = d[:r.max_tokens]
        if d and seq.matcher is not None:  # a constrained sequence: what its grammar allows
            d = d[:grammar_prefix(seq.matcher, d)]
        if d:
            out[r.seq_id] = d
    return out


def forced_drafts(running: list[Sequence], jump: JumpForward,
                  taken: dict[str, list[int]]) -> dict[str, list[int]]:
    """Jump-forward drafts, by ``seq_id``, of the constrained decoding sequences that have no
    draft in ``taken``; empty when more than ``jump.max_seqs`` sequences decode."""
    decoding = [s for s in running if in_decode_phase(s)]
    if not decoding or not jump.applies_at(len(decoding)):
        return {}
    out = {}
    for seq in decoding:
        if seq.matcher is None or seq.seq_id in taken:
            continue
        draft = jump.draft(seq.matcher, _room(seq), seq.token_ids)
        if draft:
            out[seq.seq_id] = draft
    return out
