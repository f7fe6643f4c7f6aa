"""The interface between the engine and a grammar library.

A ``GrammarBackend`` compiles a ``StructuredSpec`` into an opaque compiled grammar (thread-safe;
raises ``GrammarError`` naming the problem) and makes ``Matcher`` objects from it. A matcher
belongs to one sequence and is driven by the engine thread only: ``accept(token)`` (False,
state unchanged, if the grammar forbids it), ``fill_bitmask(bitmask, row)`` (bit ``t`` set iff
token ``t`` is allowed; EOS only where the grammar can end), ``rollback(k)``,
``is_terminated()``, ``error()`` (why it can go no further, else None), ``forced_text()`` (the
longest text every continuation starts with) and ``forced_tokens()`` (the library's own
tokenization of it); the last two change nothing and feed jump-forward drafts.

``fill_bitmasks(matchers, bitmask, rows)`` fills row ``rows[i]`` from ``matchers[i]`` (in
parallel where the library can); ``apply_bitmask(logits, bitmask, rows)`` sets the forbidden
logits of those rows (the same row numbers in both tensors) to -inf, in place, on the logits'
device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.params.structured import StructuredSpec


class GrammarError(ValueError):
    """A constraint that does not compile (a 400 naming the problem)."""


class Matcher(Protocol):
    def accept(self, token: int) -> bool: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def rollback(self, k: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def error(self) -> str | None: ...

    def forced_text(self) -> str: ...

    def forced_tokens(self) -> list[int]: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredSpec) -> Any: ...

    def matcher(self, compiled: Any, jump_forward: bool = True) -> Matcher: ...

    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None: ...
