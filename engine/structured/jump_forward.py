"""Jump-forward drafts: the text a grammar forces, verified like speculative drafts.

Under a JSON schema much of the output is fixed by the grammar (keys, quotes, separators,
closing brackets). Instead of appending that text without the model (SGLang's jump-forward,
which can change the output), kvserve proposes its tokens as a **draft** that the step verifies
exactly as a speculative one (``engine.spec_decode.verifier`` under the grammar's masks): the
output is plain constrained decoding's, token for token, and a forced stretch costs one
multi-row step. The draft comes from the first source that gives a token the grammar accepts:

1. the sequence's own tokens (when the caller passes them; only in states where the grammar
   forces some text): the continuation of the latest earlier occurrence of its last 2 to 4
   tokens (``engine.spec_decode.ngram.ngram_draft``), cut to what the grammar accepts;
2. the model tokenizer's encoding of ``Matcher.forced_text()``, cut to what the grammar accepts;
3. the grammar library's own tokenization (``Matcher.forced_tokens()``), when 2 gives nothing
   (why this order, and the step counts: docs/decisions.md#jump-forward-draft-sources)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.spec_decode.ngram import ngram_draft
from engine.structured.backend import Matcher
from engine.structured.draft_masks import grammar_prefix

DRAFT_CHARS_PER_TOKEN = 32
CONTEXT_NGRAM = (2, 4)  # the n-gram lengths matched in the sequence's tokens (shortest, longest)


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
        self.use_context = True  # source 1 on (off only to measure what it buys)

    def applies_at(self, num_decoding: int) -> bool:
        return self.max_seqs is None or num_decoding <= self.max_seqs

    def draft(self, matcher: Matcher, limit: int,
              context: Sequence[int] | None = None) -> list[int]:
        """At most ``min(limit, max_tokens)`` tokens, every one accepted by ``matcher``, in a
        state where the grammar forces some text ([] when the next character is free):
        continuing ``context`` (the sequence's prompt and output tokens, ending where
        ``matcher`` stands) where it repeats itself, else the forced text's tokens (module
        docstring). ``matcher`` is left as it was."""
        limit = min(limit, self.max_tokens)
        if limit < 1 or matcher.is_terminated():
            return []
        text = matcher.forced_text()
        if not text:
            return []
        if context is not None and self.use_context:
            ids = ngram_draft(context, limit, *CONTEXT_NGRAM)
            n = grammar_prefix(matcher, ids) if ids else 0
            if n:
                return ids[:n]
        # A token spans a few characters: the draft's tokens lie well inside this much of a
        # forced text (which the grammar's shape bounds, engine.structured.grammar_shape).
        ids = list(self._encode(text[:DRAFT_CHARS_PER_TOKEN * limit]))[:limit]
        n = grammar_prefix(matcher, ids)
        if n == 0:
            ids = matcher.forced_tokens()[:limit]
            n = grammar_prefix(matcher, ids)
        return ids[:n]

    def observe(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
