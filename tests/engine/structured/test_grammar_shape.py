"""The shape check of a constraint's grammar (engine.structured.grammar_shape): a grammar that
admits no finite output, or that can reach a rule that never ends, is refused with a message
naming the problem; every other grammar passes with a bound on the text one rule can force, and
jump-forward drafts are made only where that bound is small. Issue 64 item 1: the recursive
schema below (109 bytes in a request) made xgrammar's forced-text search allocate until the
host's OOM killer ended the server."""

from __future__ import annotations

import pytest

from engine.params.structured import StructuredSpec as S
from engine.structured.backend import GrammarError
from engine.structured.grammar_shape import FORCED_LIMIT, check_shape
from tests.support.byte_grammar import EOS, allowed

RECURSIVE = {"$ref": "#/$defs/a", "$defs": {"a": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}}

REFUSED = {
    "an object that requires itself": (S.json_schema(RECURSIVE), "admits no complete output"),
    "a dead branch of anyOf": (S.json_schema({"anyOf": [{"type": "string"},
                                                         {"$ref": "#/$defs/a"}],
                                               "$defs": RECURSIVE["$defs"]}), "can never end"),
    "a class that matches nothing": (S.text("regex", r"[^\s\S]"), "admits no complete output"),
    "a pattern that matches nothing": (S.json_schema({"type": "string", "pattern": r"[^\s\S]"}),
                                       "admits no complete output"),
    "a rule that only recurses": (S.text("grammar", 'root ::= "a" root'),
                                  "admits no complete output"),
    "a reachable rule that never ends": (S.text("grammar", 'root ::= "a" x | "b"\nx ::= "c" x'),
                                         "rule 'x'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_grammar_that_cannot_end_is_refused_by_name(name):
    spec, needle = REFUSED[name]
    with pytest.raises(GrammarError, match=needle):
        check_shape(spec)


@pytest.mark.parametrize("spec", [
    S.json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}),
    S.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {  # recursion that may stop
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}}),
    S.json_schema({"enum": [f"v{i}" for i in range(5000)]}),
    S.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 2}),
    S("json_object"), S.choice(["yes", "no"]), S.text("regex", r"(\w+\s?){1,500}x"),
    S.text("grammar", 'root ::= (w " "?){1,500} "x"\nw ::= [a-zA-Z0-9_]+'),
])
def test_grammars_that_can_end_pass_with_a_small_forced_bound(spec):
    shape = check_shape(spec)
    assert shape.forced_bound is not None and shape.jump_forward


def test_a_grammar_that_forces_a_long_text_gets_no_jump_forward(tok, backend):
    spec = S.text("regex", "(a{100}){100}x")  # forces 10,001 characters
    shape = check_shape(spec)
    assert shape.forced_bound is not None and shape.forced_bound > FORCED_LIMIT
    assert not shape.jump_forward
    m = backend.matcher(backend.compile(spec), jump_forward=False)
    assert m.forced_text() == "" and m.forced_tokens() == []
    a = tok.encode("a", add_special_tokens=False)
    assert allowed(backend, m) == set(a)  # the grammar itself still constrains
    assert EOS not in allowed(backend, m)


def test_a_spec_xgrammar_cannot_parse_is_left_to_the_compile():
    shape = check_shape(S.json_schema({"$ref": "#"}))  # a cycle with no content
    assert shape.forced_bound is None and not shape.jump_forward
