"""What a constraint's grammar can do, read off xgrammar's rule table before any request runs
it: whether every rule a matcher can reach can also end, and how much text one rule can force.

A rule that can never end admits no finite string (a matcher led into it allows tokens forever
and its forced text never ends): ``check_shape`` refuses such a constraint (a ``GrammarError``,
a 400 naming the rule) and bounds the rest: ``forced_bound`` is an upper bound on the bytes one
rule on a matcher's stack can force (the shortest completion of the longest alternative,
repetitions counted), so the forced text at any state is at most that times the stack's depth.
Jump-forward drafts are made only where it is at most ``FORCED_LIMIT``
(engine.structured.routing); a grammar the analysis cannot read is never refused for it and
gets no jump-forward.

Both libraries implement the same language for a spec, so xgrammar's parse of it (the grammar,
not the compiled token masks: cheap, no tokenizer) stands for llguidance's too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError

FORCED_LIMIT = 4096  # bytes one rule may force for jump-forward drafts to be made from it
_SAT = 1 << 40  # lengths saturate here ("more than anything that could be generated")
_MAX_PASSES = 64

# xgrammar's GrammarExprType (cpp/grammar_impl.h): the first int of every serialised expression.
BYTES, CLASS, CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT, TOKEN, \
    EXCLUDE_TOKEN, TOKEN_TAG_DISPATCH, REGEX, SUBSTRING = range(14)
_MAX_CODEPOINT = 0x10FFFF


@dataclass(frozen=True)
class GrammarShape:
    """``forced_bound``: bytes one stack frame can force (``_SAT`` when unbounded in practice);
    None when the grammar could not be analysed (then: no jump-forward, no refusal)."""

    forced_bound: int | None

    @property
    def jump_forward(self) -> bool:
        return self.forced_bound is not None and self.forced_bound <= FORCED_LIMIT


class _Unreadable(Exception):
    """The serialised grammar is not in a form this analysis knows."""


def check_shape(spec: StructuredSpec) -> GrammarShape:
    """The shape of ``spec``'s grammar; raises ``GrammarError`` when it admits no finite output
    or a rule it can reach never ends. A spec xgrammar cannot parse is left to the compile that
    follows (which names the problem)."""
    try:
        grammar = _grammar(spec)
    except Exception:  # noqa: BLE001 - the compile reports the same problem with its message
        return GrammarShape(None)
    return shape_of(grammar, spec.kind)


def shape_of(grammar: Any, kind: str = "grammar") -> GrammarShape:
    """``check_shape`` on an ``xgrammar.Grammar``."""
    try:
        table = _Table(json.loads(grammar.serialize_json()))
        lengths = table.min_lengths()
    except _Unreadable:
        return GrammarShape(None)
    reachable = table.reachable()
    if lengths.rules[table.root] >= _SAT:
        raise GrammarError(f"the {kind} constraint admits no complete output (nothing it "
                           f"accepts ever ends)")
    for rule in reachable:
        if lengths.rules[rule] >= _SAT:
            raise GrammarError(
                f"the {kind} constraint can never end once it enters rule "
                f"'{table.names[rule]}' (e.g. an object that requires itself, or a class that "
                f"matches nothing): a model led into it could not finish; make that part "
                f"optional or remove it")
    bound = max((lengths.longest_rest(table.bodies[r]) for r in reachable), default=0)
    return GrammarShape(min(bound, _SAT))


def _grammar(spec: StructuredSpec) -> Any:
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
        return xgr.Grammar.from_ebnf(f"root ::= {alts}")
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.value)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.value)
    raise _Unreadable(spec.kind)


def _sat(n: int) -> int:
    return n if n < _SAT else _SAT


def _class_is_empty(data: list[int]) -> bool:
    """A character class ``[is_negative, lo0, hi0, ...]`` that matches no character."""
    ranges = sorted(zip(data[1::2], data[2::2], strict=True))
    if not data[0]:
        return not any(lo <= hi for lo, hi in ranges)
    covered = 0  # the negated class is empty iff its ranges cover every code point
    for lo, hi in ranges:
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODEPOINT


class _Table:
    """xgrammar's serialised grammar: rules (name, body expression) and expressions (type,
    data), children always before their parents."""

    def __init__(self, d: dict[str, Any]) -> None:
        try:
            data, starts = d["grammar_expr_data"], d["grammar_expr_indptr"]
            self.exprs = [(data[s], data[s + 2:s + 2 + data[s + 1]]) for s in starts]
            self.names = [r[0] for r in d["rules"]]
            self.bodies = [int(r[1]) for r in d["rules"]]
            self.root = int(d["root_rule_id"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise _Unreadable(str(exc)) from None
        n = len(self.exprs)
        for i, (kind, args) in enumerate(self.exprs):
            if kind in (SEQUENCE, CHOICES) and any(not 0 <= c < i for c in args):
                raise _Unreadable(f"expression {i} refers forward")
            if kind in (RULE_REF, REPEAT) and not (args and 0 <= args[0] < len(self.names)):
                raise _Unreadable(f"expression {i} names no rule")
        if not all(0 <= b < n for b in self.bodies) or not 0 <= self.root < len(self.names):
            raise _Unreadable("a rule body is out of range")

    def rules_of(self, expr: int) -> list[int]:
        """The rules an expression's matcher may enter directly."""
        kind, args = self.exprs[expr]
        if kind in (RULE_REF, REPEAT):
            return [args[0]]
        if kind == TAG_DISPATCH:  # [tag expr, rule]*, loop_after_dispatch, excluded strings
            return [r for r in args[1:len(args) - 2:2] if 0 <= r < len(self.names)]
        if kind == TOKEN_TAG_DISPATCH:  # [count, (token, rule) * count, ...]
            count = args[0] if args else 0
            return [r for r in args[2:2 + 2 * count:2] if 0 <= r < len(self.names)]
        return []

    def reachable(self) -> list[int]:
        seen, todo = {self.root}, [self.root]
        while todo:
            stack = [self.bodies[todo.pop()]]
            visited: set[int] = set()
            while stack:
                e = stack.pop()
                if e in visited:
                    continue
                visited.add(e)
                kind, args = self.exprs[e]
                if kind in (SEQUENCE, CHOICES):
                    stack.extend(args)
                for r in self.rules_of(e):
                    if r not in seen:
                        seen.add(r)
                        todo.append(r)
        return sorted(seen)

    def min_lengths(self) -> _Lengths:
        lengths = _Lengths(self)
        for _ in range(_MAX_PASSES):
            if not lengths.sweep():
                return lengths
        raise _Unreadable("the shortest lengths did not settle")


class _Lengths:
    """The shortest string each rule and expression matches (bytes; ``_SAT``: none), computed
    by sweeps in expression order until nothing shrinks."""

    def __init__(self, table: _Table) -> None:
        self.t = table
        self.rules = [_SAT] * len(table.names)
        self.exprs = [_SAT] * len(table.exprs)
        self._regex: dict[str, tuple[int, int]] = {}
        self._rest: list[int] | None = None

    def sweep(self) -> bool:
        changed = False
        body_of = {b: r for r, b in enumerate(self.t.bodies)}
        for i in range(len(self.t.exprs)):
            value = self._expr(i)
            if value < self.exprs[i]:
                self.exprs[i] = value
            rule = body_of.get(i)
            if rule is not None and self.exprs[i] < self.rules[rule]:
                self.rules[rule] = self.exprs[i]
                changed = True
        # several rules may share one body expression
        for r, b in enumerate(self.t.bodies):
            if self.exprs[b] < self.rules[r]:
                self.rules[r], changed = self.exprs[b], True
        return changed

    def _expr(self, i: int) -> int:
        kind, args = self.t.exprs[i]
        if kind == BYTES:
            return len(args)
        if kind == CLASS:
            return _SAT if _class_is_empty(args) else 1
        if kind in (CLASS_STAR, EMPTY, TAG_DISPATCH, TOKEN_TAG_DISPATCH, SUBSTRING):
            return 0
        if kind == RULE_REF:
            return self.rules[args[0]]
        if kind == SEQUENCE:
            return _sat(sum(self.exprs[c] for c in args))
        if kind == CHOICES:
            return min((self.exprs[c] for c in args), default=_SAT)
        if kind == REPEAT:
            low = args[1] if len(args) > 1 else 0
            return 0 if low <= 0 else _sat(low * self.rules[args[0]])
        if kind in (TOKEN, EXCLUDE_TOKEN):
            return 1
        if kind == REGEX:
            return self._regex_shape(args)[0]
        raise _Unreadable(f"expression type {kind}")

    def _regex_shape(self, args: list[int]) -> tuple[int, int]:
        """(shortest length, longest rest) of a regex body ``[json_string, bytes...]``, from
        xgrammar's own parse of the pattern."""
        pattern = bytes(b & 0xFF for b in args[1:]).decode("utf-8", errors="replace")
        if pattern not in self._regex:
            import xgrammar as xgr

            try:
                table = _Table(json.loads(xgr.Grammar.from_regex(pattern).serialize_json()))
            except _Unreadable:
                raise
            except Exception as exc:  # noqa: BLE001
                raise _Unreadable(f"regex: {exc}") from None
            inner = table.min_lengths()
            rest = max((inner.longest_rest(table.bodies[r]) for r in table.reachable()),
                       default=0)
            self._regex[pattern] = (inner.rules[table.root],
                                    _sat(rest * max(len(table.names), 1)))
        return self._regex[pattern]

    def longest_rest(self, expr: int) -> int:
        """An upper bound on the shortest completion from anywhere inside ``expr`` (its own
        frame only): a sequence's parts added, the longest alternative of a choice."""
        if self._rest is None:
            rest = [0] * len(self.t.exprs)
            for i, (kind, args) in enumerate(self.t.exprs):  # children come first
                if kind == SEQUENCE:
                    rest[i] = _sat(sum(rest[c] for c in args))
                elif kind == CHOICES:
                    rest[i] = max((rest[c] for c in args), default=0)
                elif kind == REGEX:
                    rest[i] = self._regex_shape(args)[1]
                else:
                    rest[i] = self.exprs[i]
            self._rest = rest
        return self._rest[expr]
