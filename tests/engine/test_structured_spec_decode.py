"""Constrained decoding with speculative decoding (n-gram drafts, and jump-forward drafts of the
grammar's forced text) on a tiny random Llama: under a grammar, greedy output is token for token
the output without any drafts while drafts are really accepted; seeded sampled outputs are valid
and reproducible; a recompute preemption mid-object keeps the output; the KV pool ends clean.

The model is initialised with a small weight scale (0.05), so its continuations fall into short
loops and n-gram drafts get accepted (as in test_spec_decode_engine)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.params.structured import StructuredSpec

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32, 4/block
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None}
REGEX = "([ab]{1,3} ){3,12}x"
SCHEMA = {"type": "object", "required": ["k"], "properties": {"k": {
    "type": "array", "items": {"enum": ["ab", "ba"]}, "minItems": 3, "maxItems": 12}}}
SPECS = {
    "regex": StructuredSpec.text("regex", REGEX),
    "choice": StructuredSpec.choice(["abab abab abab", "abba abba", "bbbb"]),
    "json": StructuredSpec.json_schema(SCHEMA),
}
PROMPTS = [list(b"ab ab ab ba ab "), list(b"abab abab ab"), list(b'["ab", "ab", "ba"')]
NO_JUMP = {"jump_forward_tokens": 0}
JUMP = {"jump_forward_tokens": 8, "jump_forward_max_seqs": None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("spec"), "llama", seed=2,
                               initializer_range=0.05)


def _llm(model_dir, spec: bool, blocks: int = 2048, jump: dict = NO_JUMP, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=4, kv_cache_memory=blocks * BLOCK_BYTES,
               structured_outputs_config=jump, **kw)
    if spec:
        cfg["speculative_config"] = NGRAM
    return LLM(str(model_dir), **cfg)


@pytest.fixture(scope="module")
def base(model_dir):
    return _llm(model_dir, spec=False)


@pytest.fixture(scope="module")
def spec(model_dir):
    return _llm(model_dir, spec=True)


@pytest.fixture(scope="module")
def jump(model_dir):
    """Jump-forward drafts alone (no proposer), at every batch size."""
    return _llm(model_dir, spec=False, jump=JUMP)


def _valid(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in json.loads(SPECS["choice"].value), text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


def _assert_clean(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_under_a_grammar_is_identical_and_drafts_are_accepted(base, spec, kind):
    params = SamplingParams(temperature=0, max_tokens=100, structured=SPECS[kind])
    want = [o.outputs[0] for o in base.generate(PROMPTS, params)]
    before = spec.stats()
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params)]
    after = spec.stats()
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "stop"
        _valid(kind, g.text)
    accepted = (after["spec_decode_num_accepted_tokens"]
                - before["spec_decode_num_accepted_tokens"])
    assert accepted > 0
    assert after["structured_constrained_rows"] > before["structured_constrained_rows"]
    _assert_clean(spec)


@pytest.mark.parametrize("kind", list(SPECS))
def test_jump_forward_drafts_keep_greedy_output_and_are_accepted(base, jump, kind):
    params = SamplingParams(temperature=0, max_tokens=100, structured=SPECS[kind])
    want = [o.outputs[0] for o in base.generate(PROMPTS, params)]
    before = jump.stats()
    got = [o.outputs[0] for o in jump.generate(PROMPTS, params)]
    after = jump.stats()
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    drafted = (after["structured_jump_forward_drafted"]
               - before["structured_jump_forward_drafted"])
    accepted = (after["structured_jump_forward_accepted"]
                - before["structured_jump_forward_accepted"])
    assert 0 < accepted <= drafted
    # The forced tokens were verified, not counted as speculation.
    assert after["spec_decode_num_draft_tokens"] == before["spec_decode_num_draft_tokens"]
    assert after["num_steps"] - before["num_steps"] < sum(len(w.token_ids) for w in want)
    _assert_clean(jump)


def test_jump_forward_with_ngram_drafts_and_recompute_preemption_keeps_the_output(model_dir,
                                                                                 base):
    prompts = [list(b"request %d: ab ab " % i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=100, structured=SPECS["json"])
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    tight = _llm(model_dir, spec=True, blocks=48, jump=JUMP, preemption_mode="recompute")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    stats = tight.stats()
    assert stats["num_preemptions_recompute"] > 0
    assert stats["structured_jump_forward_accepted"] > 0
    assert got == want
    _assert_clean(tight)


def test_seeded_samples_under_a_grammar_are_valid_and_reproducible(spec):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=100,
                            structured=SPECS["json"])
    first = spec.generate(PROMPTS, params)
    again = spec.generate(PROMPTS, params)
    for a, b in zip(first, again, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            if ca.finish_reason == "stop":
                _valid("json", ca.text)
            else:
                assert ca.finish_reason == "length"
    assert sum(c.finish_reason == "stop" for r in first for c in r.outputs) >= 6
    _assert_clean(spec)


def test_a_recompute_preemption_mid_object_keeps_the_output(model_dir, base):
    prompts = [list(b"request %d: ab ab " % i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=100, structured=SPECS["json"])
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    tight = _llm(model_dir, spec=True, blocks=48, preemption_mode="recompute")
    got = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions_recompute"] > 0
    assert [c.token_ids for c in got] == want
    _assert_clean(tight)


def test_a_head_restricted_to_the_allowed_tokens_keeps_tokens_and_logprobs(model_dir):
    """On a packed head, constrained rows whose grammar allows few tokens get their logits
    computed at those tokens only (engine/runner/logit_columns.py): the greedy tokens and
    every logprob equal the full head's, with jump-forward drafts and n-gram drafts."""
    llm = _llm(model_dir, spec=True, jump=JUMP, quantization="int8")
    assert llm.engine.restrict_logits_head
    got = {}
    for restrict in (True, False):
        llm.engine.restrict_logits_head = restrict
        before = llm.stats()["structured_restricted_rows"]
        for kind, structured in SPECS.items():
            params = SamplingParams(temperature=0, max_tokens=40, logprobs=3,
                                    structured=structured)
            outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
            got[restrict, kind] = [(o.token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                  for step in o.logprobs]) for o in outs]
        restricted = llm.stats()["structured_restricted_rows"] - before
        assert (restricted > 0) == restrict
    for kind in SPECS:
        assert got[True, kind] == got[False, kind], kind
    _assert_clean(llm)


def test_a_draft_mask_that_fails_to_fill_ends_only_its_request(model_dir):
    """Draft rows' bitmasks are filled before the forward pass, outside any one request's
    guard; a failure there is retried in the request's own verification, so it ends that
    request (abort, with the error) while the others in the step finish."""
    llm = _llm(model_dir, spec=False, jump=JUMP)
    core = llm.engine
    structured = SamplingParams(temperature=0, max_tokens=30, structured=SPECS["json"])
    core.add_request("warm", PROMPTS[2], structured)  # the grammar compiled, the routing made
    while core.has_unfinished_requests():
        core.step()
    core.structured.fill_draft = lambda matcher, draft: (_ for _ in ()).throw(
        RuntimeError("no bitmask today"))
    core.add_request("victim", PROMPTS[2], structured)
    core.add_request("other", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["victim"].outputs[0].finish_reason == "abort"
    assert "no bitmask today" in finals["victim"].error
    assert finals["other"].error is None and len(finals["other"].outputs[0].token_ids) == 8
    _assert_clean(llm)
