"""Jump-forward drafts: the text a grammar forces, verified like speculative drafts.

Under a JSON schema much of the output is fixed by the grammar: keys, quotes, separators, the
closing brackets. Decoding it one token a step spends a full forward pass on a token the model
has no choice about. SGLang's jump-forward decoding appends such text without the model; that
can change the output (the forced text's tokenization need not be the one the model would have
produced token by token). kvserve instead proposes the forced text's tokens as a **draft** that
the step verifies exactly as a speculative one (``engine.spec_decode.verifier`` under the
grammar's masks): the output is the one plain constrained decoding gives, token for token, and
the forced stretch costs one multi-row step instead of one step per token.

The draft is the model tokenizer's own encoding of ``Matcher.forced_text()`` (what the model saw
in training, so verification keeps most of it), cut to what the grammar accepts; when that is
nothing (a tokenizer that prefixes a space, say) the grammar library's own tokenization
(``Matcher.forced_tokens()``) is tried. Measured on the embedded model over the four-people
schema of benchmarks/structured_vs_llamacpp.py: 540 output tokens took 208 steps with these
drafts instead of 540 (332 of 532 drafted tokens kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.structured.backend import Matcher
from engine.structured.drafts import grammar_prefix


class JumpForward:
    """Drafts of at most ``max_tokens`` forced tokens per sequence and step, in steps where at
    most ``max_seqs`` sequences decode (None: any number). ``encode`` is the model tokenizer's
    ``text -> token ids`` without special tokens. Counts what it proposed and what verification
    kept (``observe``)."""

    def __init__(self, encode: Callable[[str], Sequence[int]], max_tokens: int,
                 max_seqs: int | None) -> None:
        if max_tokens < 1:
            raise ValueError(f"jump-forward drafts need max_tokens >= 1; got {max_tokens}")
        self._encode = encode
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.drafted = 0  # tokens proposed, cumulative
        self.accepted = 0  # of them kept by verification
        self.steps = 0  # sequence-steps that carried a jump-forward draft

    def applies_at(self, num_decoding: int) -> bool:
        return self.max_seqs is None or num_decoding <= self.max_seqs

    def draft(self, matcher: Matcher, limit: int) -> list[int]:
        """At most ``min(limit, max_tokens)`` tokens the grammar forces after ``matcher``'s
        state, every one accepted by it ([] when the next character is free). ``matcher`` is
        left as it was."""
        limit = min(limit, self.max_tokens)
        if limit < 1 or matcher.is_terminated():
            return []
        text = matcher.forced_text()
        if not text:
            return []
        ids = list(self._encode(text))[:limit]
        n = grammar_prefix(matcher, ids)
        if n == 0:
            ids = matcher.forced_tokens()[:limit]
            n = grammar_prefix(matcher, ids)
        return ids[:n]

    def observe(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
