"""``GrammarBackend`` on xgrammar: for JSON schemas its per-token mask fill is faster than
llguidance's, for bounded-repetition regexes much slower
(docs/decisions.md#grammar-libraries), so engine.structured.routing measures both per constraint;
EBNF grammars and structural tags are xgrammar's alone.

JSON is constrained to compact separators (``", "`` and ``": "``, no free whitespace): a small
model allowed any whitespace can loop on newlines until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError


class XGrammarMatcher:
    """One sequence's matcher (see ``engine.structured.backend.Matcher``)."""

    __slots__ = ("_m", "_jump_forward")

    def __init__(self, compiled: xgr.CompiledGrammar, jump_forward: bool = True) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._jump_forward = jump_forward  # False: forced_text is "" (unbounded forced text)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, k: int) -> None:
        if k:
            self._m.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def error(self) -> str | None:
        return None  # xgrammar has no error state: a dead end is a mask that allows nothing

    def forced_text(self) -> str:
        return self._m.find_jump_forward_string() if self._jump_forward else ""

    def forced_tokens(self) -> list[int]:
        return list(self._m.find_jump_forward_tokens()) if self._jump_forward else []


class XGrammarBackend:
    """Compiles specs for one tokenizer and vocabulary (``vocab_size``: the model's logits
    width, which may exceed the tokenizer's; the extra ids are never allowed)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        # Caching is ours (engine.structured.cache, keyed by canonical text).
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own types
            raise GrammarError(f"the {spec.kind} constraint does not compile: "
                               f"{_message(exc)}") from None

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
            return c.compile_grammar(f"root ::= {alts}")
        if spec.kind == "grammar":
            return c.compile_grammar(spec.value)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.value)
        raise GrammarError(f"unsupported constraint kind {spec.kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar, jump_forward: bool = True) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, jump_forward)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_bitmasks(self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Row ``rows[i]`` of ``bitmask`` from ``matchers[i]`` (in parallel for several)."""
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask,
                                                      indices=list(rows))

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Forbidden logits of ``rows`` (the same rows of ``bitmask``) to -inf, in place.

        CPU logits: the rows' bits unpacked by numpy and masked row by row, the same result as
        xgrammar's CPU kernel in a fraction of its time
        (docs/decisions.md#grammar-libraries). Other devices: xgrammar's own kernel."""
        if logits.device.type == "cpu" and bitmask.device.type == "cpu":
            apply_bitmask_on_cpu(logits, bitmask, rows, min(logits.shape[-1], self.vocab_size))
            return
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=list(rows))


def apply_bitmask_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int],
                  width: int) -> None:
    """Bit ``t`` of row ``r`` clear (little-endian int32 words, xgrammar's layout): logit
    ``[r, t]`` to -inf, for ``t < width``."""
    packed = bitmask.contiguous().numpy().view(np.uint8)[list(rows)]
    forbidden = torch.from_numpy(
        np.unpackbits(packed, axis=-1, count=width, bitorder="little") == 0)
    with torch.inference_mode():  # the step's logits may be inference tensors
        for k, r in enumerate(rows):
            logits[r, :width].masked_fill_(forbidden[k], float("-inf"))


def _message(exc: Exception) -> str:
    """xgrammar's message without its ``[hh:mm:ss] /project/cpp/file.cc:N:`` prefix."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[0-9:]+\]\s*\S+:\d+:\s*", "", lines[0])
