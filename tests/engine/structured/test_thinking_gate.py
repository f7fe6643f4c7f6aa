"""GatedMatcher (engine/structured/gated.py): free thought, a budget forcing the closing marker
token by token, the constraint from the token after it, and rollback across the phases. Over
xgrammar's real matcher and the tiny byte vocabulary (markers several tokens long)."""

from __future__ import annotations

import json

import pytest

from engine.loading.tiny import VOCAB
from engine.params.structured import StructuredSpec
from engine.params.thinking import ThinkingGate
from engine.structured.draft_masks import grammar_prefix
from engine.structured.gated import GatedMatcher
from engine.structured.jump_forward import JumpForward
from tests.support.byte_grammar import EOS, allowed

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def gate(tok, budget=None, inside=True) -> ThinkingGate:
    return ThinkingGate(tuple(ids(tok, "<think>")), tuple(ids(tok, "</think>")), budget, inside)


def json_matcher(backend):
    return backend.matcher(backend.compile(StructuredSpec.json_schema(SCHEMA)))


def feed(m, tok, text: str) -> None:
    for t in ids(tok, text):
        assert m.accept(t), (text, t)


def test_the_thought_is_free_and_the_schema_applies_after_it(tok, backend):
    m = GatedMatcher(gate(tok), json_matcher(backend))
    assert len(allowed(backend, m)) == VOCAB  # anything, EOS included, while thinking
    feed(m, tok, "hmm } not json {{")
    assert not m.answering
    feed(m, tok, "</think>")
    assert m.answering
    assert allowed(backend, m) == {ids(tok, "{")[0]}  # the schema, from its start
    feed(m, tok, '{"a": 12}')
    assert m.is_terminated() or EOS in allowed(backend, m)


def test_without_a_constraint_the_answer_is_free(tok, backend):
    m = GatedMatcher(gate(tok, budget=2), None)
    feed(m, tok, "ab</think>")
    assert m.answering and len(allowed(backend, m)) == VOCAB and not m.is_terminated()


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_budget_forces_the_closing_marker_to_the_token(tok, backend, budget):
    end = ids(tok, "</think>")
    m = GatedMatcher(gate(tok, budget), json_matcher(backend))
    feed(m, tok, "x" * budget)  # the budget's tokens are free
    for j, t in enumerate(end):
        assert allowed(backend, m) == {t}, j  # then only the marker, token by token
        assert m.forced_tokens() == end[j:]
        assert not m.accept(ids(tok, "y")[0])
        assert m.accept(t)
    assert m.answering and allowed(backend, m) == {ids(tok, "{")[0]}


def test_a_thought_ended_before_the_budget_is_not_forced(tok, backend):
    m = GatedMatcher(gate(tok, budget=50), json_matcher(backend))
    feed(m, tok, "ok</think>")
    assert m.answering and m.forced_tokens()[:1] == ids(tok, "{")  # the schema's own


def test_outside_the_thought_the_model_opens_one_or_answers_at_once(tok, backend):
    # the prompt did not open it (Qwen3 with thinking on): the first token opens the thought
    # (then the marker is finished, and the budget counts from its end) or begins the answer
    m = GatedMatcher(gate(tok, budget=1, inside=False), json_matcher(backend))
    assert allowed(backend, m) == {ids(tok, "<")[0], ids(tok, "{")[0]}
    feed(m, tok, "<")
    assert allowed(backend, m) == {ids(tok, "t")[0]}  # a marker once begun is finished
    assert m.forced_tokens() == ids(tok, "think>")
    feed(m, tok, "think>z")
    assert allowed(backend, m) == {ids(tok, "</think>")[0]}
    skip = GatedMatcher(gate(tok, budget=1, inside=False), json_matcher(backend))
    feed(skip, tok, '{"a": 3}')  # no thought: the schema from the first token
    assert skip.answering
    assert not skip.accept(ids(tok, "x")[0])
    free = GatedMatcher(gate(tok, inside=False), None)  # no constraint: anything answers
    assert len(allowed(backend, free)) == VOCAB
    feed(free, tok, "hello")
    assert free.answering


def test_rollback_undoes_exactly_what_accept_did_across_phases(tok, backend):
    idle = GatedMatcher(gate(tok, budget=1, inside=False), json_matcher(backend))
    first = allowed(backend, idle)
    for text in ("<thi", '{"a'):
        feed(idle, tok, text)
        idle.rollback(len(ids(tok, text)))
        assert allowed(backend, idle) == first and not idle.answering
    m = GatedMatcher(gate(tok, budget=3), json_matcher(backend))
    feed(m, tok, "abc</think>{")
    before = allowed(backend, m)
    feed(m, tok, '"a": 1')
    m.rollback(len(ids(tok, '"a": 1')))
    assert allowed(backend, m) == before
    m.rollback(1 + len(ids(tok, "</think>")))  # back into the forcing phase
    assert not m.answering and allowed(backend, m) == {ids(tok, "</think>")[0]}
    feed(m, tok, "</think>")
    assert allowed(backend, m) == {ids(tok, "{")[0]}  # the schema from its start again


def test_grammar_prefix_and_jump_forward_see_the_forced_marker(tok, backend):
    end = ids(tok, "</think>")
    m = GatedMatcher(gate(tok, budget=2), json_matcher(backend))
    feed(m, tok, "ab")
    draft = end + ids(tok, '{"a"')
    assert grammar_prefix(m, draft) == len(draft)  # the marker, then what the schema allows
    assert grammar_prefix(m, ids(tok, "zz")) == 0
    jf = JumpForward(lambda text: ids(tok, text), max_tokens=16, max_seqs=None)
    assert jf.draft(m, 16)[:len(end)] == end
    assert not m.answering  # drafting left it as it was


def test_the_gate_validates_its_fields():
    with pytest.raises(ValueError):
        ThinkingGate((), (1,))
    with pytest.raises(ValueError):
        ThinkingGate((1,), (2,), budget=-1)
    assert json.dumps(SCHEMA)
