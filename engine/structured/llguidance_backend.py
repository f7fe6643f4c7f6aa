"""``GrammarBackend`` on llguidance, for the kinds it shares with xgrammar: JSON schemas,
``json_object``, regexes and choices (EBNF grammars and structural tags stay with xgrammar,
whose syntax they are written in). Which library serves a constraint is measured per
constraint (engine.structured.routing): llguidance fills a bounded-repetition regex's mask
much faster than xgrammar, xgrammar a JSON schema's (docs/decisions.md#grammar-libraries).

The bitmask is xgrammar's layout (int32 words, bit ``t`` of row ``r`` = token ``t`` allowed), so
rows of either library share one tensor. JSON uses the same compact separators as the xgrammar
backend. The matcher behaves as ``engine.structured.backend.Matcher`` asks: ``accept`` leaves
the state unchanged on a refused token (llguidance's own ``consume_token`` would turn the
matcher into an error state), and ``is_terminated`` means a stop token was accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError
from engine.structured.xgrammar_backend import apply_bitmask_on_cpu

KINDS = frozenset({"json", "json_object", "regex", "choice"})
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher:
    """One sequence's matcher (see ``engine.structured.backend.Matcher``)."""

    __slots__ = ("_m", "_stop", "_n", "_ended_at", "_jump_forward")

    def __init__(self, matcher: Any, stop: frozenset[int], jump_forward: bool = True) -> None:
        self._m, self._stop = matcher, stop
        self._jump_forward = jump_forward  # False: forced_text is "" (unbounded forced text)
        self._n = 0  # tokens accepted
        self._ended_at: int | None = None  # index of the accepted stop token

    def accept(self, token: int) -> bool:
        token = int(token)
        if self._ended_at is not None:
            return False
        if token in self._stop:  # llguidance takes a stop token only by consume_token
            if not self._m.is_accepting() or not self._m.consume_token(token):
                return False
            self._ended_at = self._n
        elif self._m.try_consume_tokens([token]) != 1:
            return False
        self._n += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(self._m, bitmask, row)

    def rollback(self, k: int) -> None:
        if k:
            self._m.rollback(k)
            self._n -= k
            if self._ended_at is not None and self._ended_at >= self._n:
                self._ended_at = None

    def is_terminated(self) -> bool:
        return self._ended_at is not None

    def error(self) -> str | None:
        """Why the matcher stopped (a parser limit, a state nothing can follow), or None."""
        if self._ended_at is not None or not self._m.is_error():
            return None
        return self._m.get_error().splitlines()[0][:200]

    def forced_text(self) -> str:
        if self._ended_at is not None or not self._jump_forward:
            return ""
        # Bytes that end (or start) inside a character are left for the model to produce.
        return bytes(self._m.compute_ff_bytes()).decode("utf-8", errors="ignore")

    def forced_tokens(self) -> list[int]:
        if self._ended_at is not None or not self._jump_forward:
            return []
        return [t for t in self._m.compute_ff_tokens() if t not in self._stop]


class LLGuidanceBackend:
    """Compiles the shared kinds for one tokenizer and vocabulary (``vocab_size``: the logits'
    width); ``stop_token_ids`` end the grammar where it may end."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self._stop = frozenset(int(t) for t in stop_token_ids)
        self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=sorted(self._stop))
        self._executor = llguidance.LLExecutor()
        # The library's own per-step bounds (Earley items, lexer fuel) at their defaults; short
        # errors (the verbose ones quote the parser state and the whole grammar).
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile(self, spec: StructuredSpec) -> str:
        """The grammar text, checked by building a first matcher."""
        try:
            grammar = self._grammar(spec)
        except ValueError as exc:  # the schema/regex front ends raise ValueError
            raise GrammarError(f"the {spec.kind} constraint does not compile: "
                               f"{str(exc).splitlines()[0][:300]}") from None
        matcher = self._ll.LLMatcher(self._tok, grammar, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} constraint does not compile: "
                               f"{matcher.get_error()}")
        return grammar

    def _grammar(self, spec: StructuredSpec) -> str:
        ll = self._ll.LLMatcher
        if spec.kind == "json":
            return ll.grammar_from_json_schema(spec.value, defaults=_JSON_OPTIONS)
        if spec.kind == "json_object":
            return ll.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return ll.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
            return ll.grammar_from_lark(f"start: {alts}")
        raise GrammarError(f"llguidance does not serve {spec.kind!r} constraints here")

    def matcher(self, compiled: str, jump_forward: bool = True) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._ll.LLMatcher(self._tok, compiled, limits=self._limits),
                                 self._stop, jump_forward)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_bitmasks(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Row ``rows[i]`` of ``bitmask`` from ``matchers[i]`` (in parallel for several)."""
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        import llguidance.torch as llt

        llt.fill_next_token_bitmask_par(self._executor,
                                        [(m._m, r) for m, r in zip(matchers, rows)], bitmask)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Forbidden logits of ``rows`` to -inf, in place (the xgrammar backend's CPU path;
        llguidance's kernel elsewhere)."""
        if logits.device.type == "cpu" and bitmask.device.type == "cpu":
            apply_bitmask_on_cpu(logits, bitmask, rows, min(logits.shape[-1], self.vocab_size))
            return
        import llguidance.torch as llt

        for r in rows:
            llt.apply_token_bitmask_inplace(logits[r], bitmask[r].to(logits.device))
