"""Speculative decoding's parts on their own: the n-gram proposer, the scheduler's draft
policy, the verification rules (greedy prefix match; point-mass rejection sampling, checked by
chi-square against the distribution the plain sampler draws from) and the packed rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from engine.config.speculative import SpeculativeConfig
from engine.params.sampling import SamplingParams
from engine.runner.batch import build_model_input
from engine.sampling.row import SamplingRow
from engine.sampling.sampler import Sampler
from engine.scheduling.speculation import propose_drafts
from engine.spec_decode.ngram import NgramProposer, ngram_draft
from engine.spec_decode.proposer import DraftRequest
from engine.spec_decode.verifier import DraftRun, rows_for_draft, split_rows, verify
from engine.step.plan import SeqChunk, StepPlan

# ---- the n-gram proposer -------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_latest_match():
    #        0  1  2  3  4  5  6  7  8  9
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    # Last 2 tokens (1, 2) occur at 0 and 4: the latest earlier one (4) wins.
    assert ngram_draft(ctx, 3, 1, 2) == [3, 8, 1]
    # Longest n first: (9, 1, 2) has no match but n=2 does.
    assert ngram_draft([5, 9, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1]
    assert ngram_draft([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert ngram_draft([1], 3, 1, 3) == []


def test_ngram_runs_on_into_its_own_draft_for_periodic_text():
    assert ngram_draft([7, 1, 2, 7, 1, 2, 7], 5, 1, 1) == [1, 2, 7, 1, 2]
    assert ngram_draft([4, 4, 4], 4, 1, 2) == [4, 4, 4, 4]


def test_ngram_proposer_respects_each_request_cap():
    prop = NgramProposer(4, 1, 3)
    out = prop.propose([DraftRequest("a", [1, 2, 3, 1, 2], 2), DraftRequest("b", [5, 6], 4)])
    assert out == [[3, 1], []]
    with pytest.raises(ValueError):
        NgramProposer(4, 3, 2)


# ---- the scheduler's draft policy ----------------------------------------------------------


def _seq(seq_id, prompt, generated, max_tokens, computed=None, matcher=None):
    tokens = prompt + generated
    return SimpleNamespace(
        seq_id=seq_id, token_ids=tokens, num_tokens=len(tokens), num_prompt_tokens=len(prompt),
        num_computed_tokens=len(tokens) - 1 if computed is None else computed, matcher=matcher,
        request=SimpleNamespace(params=SamplingParams(max_tokens=max_tokens)))


class _AllowedSet:
    """A grammar stand-in: accepts only ``allowed`` tokens (engine.structured.backend.Matcher)."""

    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def accept(self, token):
        if token not in self.allowed:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, k):
        del self.accepted[len(self.accepted) - k:]

    def is_terminated(self):
        return False


def test_drafts_stop_at_max_tokens_and_skip_prefills():
    prop = NgramProposer(4, 1, 2)
    cfg = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None)
    running = [
        _seq("a", [1, 2, 1, 2, 1], [2], max_tokens=3),  # 1 generated: at most 3 - 1 - 1 drafts
        _seq("b", [1, 2, 1, 2, 1], [2], max_tokens=2),  # its next token is its last: no draft
        _seq("c", [1, 2, 1, 2, 1, 2], [], max_tokens=9, computed=2),  # still in prefill
        _seq("d", [3, 4, 3, 4], [3], max_tokens=50),
    ]
    assert propose_drafts(running, prop, cfg) == {"a": [1], "d": [4, 3, 4, 3]}


def test_a_constrained_sequences_draft_is_cut_where_its_grammar_forbids():
    prop = NgramProposer(4, 1, 2)
    cfg = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None)
    grammar = _AllowedSet({3, 9})
    running = [_seq("d", [3, 4, 3, 4, 9], [3, 4], max_tokens=50, matcher=grammar),
               _seq("e", [3, 4, 3, 4, 9], [3, 4], max_tokens=50)]
    assert propose_drafts(running, prop, cfg) == {"d": [9, 3], "e": [9, 3, 4, 9]}
    assert grammar.accepted == []  # left as it was


def test_the_adaptive_switch_counts_decoding_sequences():
    prop = NgramProposer(2, 1, 2)
    running = [_seq(str(i), [1, 1, 1], [1], max_tokens=9) for i in range(3)]
    assert propose_drafts(running, prop, SpeculativeConfig(disable_by_batch_size=2)) == {}
    assert len(propose_drafts(running, prop, SpeculativeConfig(disable_by_batch_size=3))) == 3
    assert len(propose_drafts(running, prop, SpeculativeConfig(disable_by_batch_size=None))) == 3


# ---- packing: a speculating chunk samples its last 1 + k rows ------------------------------


def test_model_input_samples_every_verification_row():
    plan = StepPlan((SeqChunk([5], 7, [0, 1], True),
                     SeqChunk([6, 1, 2, 3], 9, [2, 3, 4, 8], True, None, 3),
                     SeqChunk([9, 9, 9], 0, [5], False),
                     SeqChunk([8, 4], 4, [6, 7], True, None, 1)), block_size=4)
    inp = build_model_input(plan)
    assert inp.sample_seq_indices == [0, 1, 3] and inp.sample_counts == [1, 4, 2]
    assert inp.sample_indices.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert inp.positions.tolist()[1:5] == [9, 10, 11, 12]
    plain, spec = split_rows(inp.sample_counts)
    assert plain == [(0, range(0, 1))] and spec == [(1, range(1, 5)), (2, range(5, 7))]


# ---- verification --------------------------------------------------------------------------


def _row(params: SamplingParams, output=(), generator=None) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[0], output_token_ids=list(output),
                       generator=generator, eos_token_ids=frozenset({9}))


def _peaked(targets: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    for i, t in enumerate(targets):
        logits[i, t] = 5.0
    return logits


def test_greedy_keeps_the_matching_prefix_and_the_targets_next_token():
    sampler, gen = Sampler(), torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    cases = [([3, 4, 5], [3, 4, 6, 7], (3, 4, 6), 2),  # mismatch at 2: the target's token
             ([3, 4, 5], [3, 4, 5, 7], (3, 4, 5, 7), 3),  # all accepted: plus a bonus
             ([3, 4, 5], [1, 4, 5, 7], (1,), 0)]
    for draft, targets, tokens, accepted in cases:
        run = DraftRun(tuple(draft), rows_for_draft(_row(greedy), draft))
        [v], out = verify(sampler, _peaked(targets), [run], gen)
        assert v.tokens == tokens and v.num_accepted == accepted and v.row == 0
        assert out.token_ids[:len(tokens)] == list(tokens)


def test_rows_see_the_draft_as_history():
    """Penalties of row j count draft[:j]: a repetition penalty that flips the argmax once
    the token is in the output makes the greedy target differ from the raw argmax."""
    rows = rows_for_draft(_row(SamplingParams(temperature=0, repetition_penalty=10.0), [1]),
                          [3, 3])
    assert [list(r.output_token_ids) for r in rows] == [[1], [1, 3], [1, 3, 3]]
    logits = torch.tensor([[0.0, 0, 0, 2.0, 1.0]] * 3)
    [v], _ = verify(Sampler(), logits, [DraftRun((3, 3), rows)], torch.Generator())
    assert v.tokens == (3, 4) and v.num_accepted == 1  # row 1 already penalises token 3


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was emitted"
    n = counts.sum()
    return float(chisquare(counts[keep].numpy(), (probs[keep] * n).numpy()).pvalue)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.5),
])
def test_rejection_sampling_emits_the_target_distribution(params):
    """Position 0 with draft token d: the emitted token must follow p0 whatever d is (accepted
    with p0(d), else drawn from p0 without d); after an accepted d, the bonus token follows
    p1. p0 and p1 are what the plain sampler draws from (checked too)."""
    torch.manual_seed(0)
    vocab, trials = 6, 4000
    logits = torch.randn(2, vocab) * 1.5
    sampler = Sampler(seed=1)
    # The likeliest token (mostly accepted) and the least likely (mostly rejected, or of
    # probability 0 under top-k: always rejected).
    for draft in (int(logits[0].argmax()), int(logits[0].argmin())):
        rows = rows_for_draft(_row(params, [2]), [draft])
        p = sampler.target_probs(logits, list(rows))
        gen = torch.Generator().manual_seed(draft)
        first = torch.zeros(vocab)
        bonus = torch.zeros(vocab)
        # One verify call of many identical runs: each run draws its own uniforms.
        verified, _ = verify(sampler, logits.repeat(trials, 1),
                             [DraftRun((draft,), rows)] * trials, gen)
        for v in verified:
            first[v.tokens[0]] += 1
            if v.num_accepted:
                bonus[v.tokens[1]] += 1
        assert _chi2_p(first, p[0]) > 1e-3
        if p[0, draft] > 0.3:
            assert _chi2_p(bonus, p[1]) > 1e-3
    plain = torch.zeros(vocab)
    for tok in sampler(logits[:1].repeat(trials, 1), [rows[0]] * trials).token_ids:
        plain[tok] += 1
    assert _chi2_p(plain, p[0]) > 1e-3


def test_seeded_rows_use_their_own_generator():
    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.randn(3, 8)

    def run(seed):
        rows = rows_for_draft(_row(params, generator=torch.Generator().manual_seed(seed)), [1, 2])
        return verify(Sampler(), logits, [DraftRun((1, 2), rows)],
                      torch.Generator().manual_seed(99))[0][0].tokens

    assert run(5) == run(5)
    assert len({run(s) for s in range(20)}) > 1
