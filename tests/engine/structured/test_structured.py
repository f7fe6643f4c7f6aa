"""engine.structured against xgrammar on the tiny byte-level vocabulary (256 bytes, <s>, </s>):
masks, rollback, termination, speculative drafts under a grammar, the compile cache and the spec's canonical form."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config.structured import StructuredOutputsConfig
from engine.loading.tiny import VOCAB
from engine.params.structured import MAX_CONSTRAINT_CHARS, StructuredSpec
from engine.structured.backend import GrammarError
from engine.structured.cache import GrammarCache
from engine.structured.draft_masks import grammar_prefix, mask_draft_rows
from engine.structured.fill_mode import FillModeChooser
from engine.structured.masking import mask_logits
from engine.structured.state import StructuredOutputs
from tests.support.byte_grammar import EOS, allowed


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_choice_masks_rollback_and_termination(tok, backend):
    m = backend.matcher(backend.compile(StructuredSpec.choice(["yes", "no"])))
    first = allowed(backend, m)
    assert first == {ids(tok, "y")[0], ids(tok, "n")[0]}
    assert not m.accept(ids(tok, "x")[0])  # forbidden: refused, state unchanged
    assert allowed(backend, m) == first
    for t in ids(tok, "ye"):
        assert m.accept(t)
    assert allowed(backend, m) == set(ids(tok, "s"))
    m.rollback(2)
    assert allowed(backend, m) == first
    for t in ids(tok, "yes"):
        assert m.accept(t)
    assert allowed(backend, m) == {EOS}  # EOS only where the grammar can end
    assert not m.is_terminated()
    assert m.accept(EOS)
    assert m.is_terminated()


def test_json_schema_accepts_a_valid_instance_and_nothing_else(tok, backend):
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["n", "tags"]}
    m = backend.matcher(backend.compile(StructuredSpec.json_schema(schema)))
    text = json.dumps({"n": 3, "tags": ["a", "b"]})
    for t in ids(tok, text):
        assert t in allowed(backend, m)
        assert EOS not in allowed(backend, m)  # mid-object: no end
        assert m.accept(t)
    assert allowed(backend, m) == {EOS}
    m2 = backend.matcher(backend.compile(StructuredSpec.json_schema(schema)))
    for t in ids(tok, '{"n": '):
        assert m2.accept(t)
    assert allowed(backend, m2) == set(ids(tok, "123456789"))  # minimum 1, maximum 9


def test_mask_logits_touches_only_constrained_rows(tok, backend):
    m = backend.matcher(backend.compile(StructuredSpec.text("regex", "[0-9]+")))
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    assert mask_logits(backend, logits, [None, m, None]) == 1
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert finite == set(ids(tok, "0123456789"))
    assert torch.equal(logits[1][list(finite)], before[1][list(finite)])
    untouched = torch.randn(2, VOCAB)
    copy = untouched.clone()
    assert mask_logits(backend, untouched, [None, None]) == 0
    assert torch.equal(untouched, copy)


@pytest.mark.parametrize("spec, needle", [
    (StructuredSpec.json_schema({"type": "nonsense"}), "nonsense"),
    (StructuredSpec.json_schema({"type": "integer", "minimum": "x"}), "number"),
    (StructuredSpec.text("regex", "(ab"), "parenthesis"),
    (StructuredSpec.text("grammar", "root ::= "), "EBNF"),
])
def test_compile_errors_name_the_problem(backend, spec, needle):
    with pytest.raises(GrammarError, match=needle) as info:
        backend.compile(spec)
    assert "/project/" not in str(info.value)


def test_cache_compiles_once_per_canonical_text_and_remembers_refusals(backend):
    cache = GrammarCache(backend.compile)
    try:
        a = cache.compile(StructuredSpec.json_schema({"type": "object", "required": ["x"],
                                                      "properties": {"x": {"type": "string"}}}))
        b = cache.compile(StructuredSpec.json_schema(
            '{"properties": {"x": {"type": "string"}}, "required": ["x"], "type": "object"}'))
        assert a is b
        bad = StructuredSpec.text("regex", "(")
        for _ in range(2):  # the second is refused from memory, without compiling again
            with pytest.raises(GrammarError, match="parenthesis"):
                cache.compile(bad)
        s = cache.stats()
        assert (s.compiles, s.compile_failures, s.cache_hits, s.refusal_hits) == (2, 1, 1, 1)
        assert sum(s.compile_buckets) == 2
    finally:
        cache.close()


def test_spec_validation():
    with pytest.raises(ValueError, match="characters"):
        StructuredSpec.json_schema({"description": "x" * MAX_CONSTRAINT_CHARS})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredSpec.json_schema("{not json")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredSpec.choice([])
    with pytest.raises(ValueError, match="must be an object"):
        StructuredSpec.json_schema([1])
    assert StructuredSpec.choice(["a", "b"]).key != StructuredSpec.choice(["b", "a"]).key


def _row_allowed(logits: torch.Tensor, row: int) -> set[int]:
    return set(torch.isfinite(logits[row]).nonzero().flatten().tolist())


def test_drafts_are_cut_to_the_grammar_and_their_rows_masked_per_position(tok, backend):
    m = backend.matcher(backend.compile(StructuredSpec.choice(["abc", "abd"])))
    assert grammar_prefix(m, ids(tok, "abx")) == 2
    assert grammar_prefix(m, ids(tok, "abd")) == 3
    assert grammar_prefix(m, [*ids(tok, "abd"), EOS, *ids(tok, "a")]) == 4  # nothing after the end
    assert grammar_prefix(m, ids(tok, "x")) == 0
    assert allowed(backend, m) == set(ids(tok, "a"))  # the matcher is left as it was
    draft = ids(tok, "ab")
    logits = torch.zeros(4, VOCAB)  # one row more than needed: left alone
    assert mask_draft_rows(backend, logits, m, draft) == 3
    assert _row_allowed(logits, 0) == set(ids(tok, "a"))
    assert _row_allowed(logits, 1) == set(ids(tok, "b"))
    assert _row_allowed(logits, 2) == set(ids(tok, "cd"))
    assert _row_allowed(logits, 3) == set(range(VOCAB))
    assert allowed(backend, m) == set(ids(tok, "a"))
    with pytest.raises(ValueError, match="not allowed"):
        mask_draft_rows(backend, torch.zeros(3, VOCAB), m, ids(tok, "ax"))
    assert allowed(backend, m) == set(ids(tok, "a"))  # rolled back on the error too


def test_rows_after_a_draft_that_ends_the_grammar_are_left_alone(tok, backend):
    m = backend.matcher(backend.compile(StructuredSpec.choice(["ab"])))
    logits = torch.zeros(4, VOCAB)
    assert mask_draft_rows(backend, logits, m, [*ids(tok, "ab"), EOS]) == 3
    assert _row_allowed(logits, 2) == {EOS}
    assert _row_allowed(logits, 3) == set(range(VOCAB))
    assert not m.is_terminated() and allowed(backend, m) == set(ids(tok, "a"))


def test_the_fill_mode_is_measured_alternately_then_held_then_measured_again():
    c = FillModeChooser(trial=2, hold=3)
    seen = []
    for slow_overlap in (5.0, 5.0, 5.0, 5.0):  # overlap costs 5 s per row, filling first 1 s
        mode = c.overlap()
        seen.append(mode)
        c.record(mode, slow_overlap if mode else 1.0, rows=1)
    assert seen == [True, False, True, False] and c.chosen is False
    for _ in range(3):
        assert c.overlap() is False
        c.record(False, 9.0, rows=1)  # held whatever it measures now
    assert c.chosen is None and c.overlap() is True  # the hold is over: measured again
    for _ in range(4):
        mode = c.overlap()
        c.record(mode, 2.0 if mode else 8.0, rows=4)
    assert c.chosen is True


@pytest.mark.parametrize("overlap", [None, True, False])
def test_a_step_mask_filled_either_way_equals_the_mask_filled_at_once(tok, overlap):
    structured = StructuredOutputs(tok, VOCAB, [EOS], StructuredOutputsConfig(isolation="thread"))
    spec = StructuredSpec.choice(["yes", "no"])
    compiled = structured.compile(spec)
    matchers = [None, structured.matcher(compiled), None, structured.matcher(compiled)]
    assert matchers[3].accept(ids(tok, "y")[0])
    want = torch.randn(4, VOCAB)
    got = want.clone()
    mask_logits(structured.backend, want, matchers)
    structured.overlap_fill = overlap
    for _ in range(10):  # through the chooser's trial steps and into its choice
        step = got.clone()
        pending = structured.start_mask(matchers)
        assert pending is not None
        structured.finish_mask(step, pending)
        assert torch.equal(step, want)
    assert structured.start_mask([None, None]) is None
    structured.close()


def test_the_cpu_mask_equals_xgrammars_own_kernel(tok, backend):
    import xgrammar as xgr

    matchers = [backend.matcher(backend.compile(StructuredSpec.choice(["yes", "no", "maybe"])))
                for _ in range(3)]
    assert matchers[1].accept(ids(tok, "m")[0])
    bitmask = backend.allocate_bitmask(5)
    rows = [0, 2, 4]
    backend.fill_bitmasks(matchers, bitmask, rows)
    logits = torch.randn(5, VOCAB)
    ours, theirs = logits.clone(), logits.clone()
    with torch.inference_mode():  # as the engine's logits are
        ours = ours.clone()
    backend.apply_bitmask(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=VOCAB, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1]) and torch.isinf(ours[2]).sum() == VOCAB - 1
