"""Jump-forward drafts: the text a grammar forces, verified like speculative drafts.

Under a JSON schema much of the output is fixed by the grammar: keys, quotes, separators, the
closing brackets. Decoding it one token a step spends a full forward pass on a token the model
has no choice about. SGLang's jump-forward decoding appends such text without the model; that
can change the output (the forced text's tokenization need not be the one the model would have
produced token by token). kvserve instead proposes the forced text's tokens as a **draft** that
the step verifies exactly as a speculative one (``engine.spec_decode.verifier`` under the
grammar's masks): the output is the one plain constrained decoding gives, token for token, and
the forced stretch costs one multi-row step instead of one step per token.

Where the draft comes from, the first source that gives a token the grammar accepts:

1. **The sequence's own tokens** (when the caller passes them): the continuation of the latest
   earlier occurrence of its last 2 to 4 tokens (``engine.spec_decode.ngram.ngram_draft``), cut
   to what the grammar accepts. Structured output repeats itself (an array's objects share
   their keys and separators), and where the same forced text came before, the model's own
   tokenization of it is what verification keeps: after ``"role": "d`` the tokenizer spells
   the forced ``octor"}, {"name": "`` as ``o|ctor|...`` while the model, under the mask, writes
   ``oc|to|r|...``, so the tokenizer's draft is rejected at its first token, three steps
   running, and the sequence's history holds the right one. The continuation may run past the
   forced text into free text (a repeated value): still a draft, still verified. Only in states
   where the grammar forces some text: in free text the same lookup guesses, and a wrong guess
   costs rows.
2. **The model tokenizer's encoding** of ``Matcher.forced_text()`` (what the model saw in
   training), cut to what the grammar accepts.
3. **The grammar library's own tokenization** (``Matcher.forced_tokens()``), when 2 gives
   nothing (a tokenizer that prefixes a space, say).

Counted on the embedded model over the four-people schema of
benchmarks/structured_vs_llamacpp.py (16 answers, 1,988 tokens, greedy): token by token takes
1,988 steps; drafts from sources 2-3 alone, 715 (65% of drafted tokens kept); with source 1
first, 610 (74% kept). benchmarks/jump_forward.py measures the wall time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.spec_decode.ngram import ngram_draft
from engine.structured.backend import Matcher
from engine.structured.drafts import grammar_prefix

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
        self.use_context = True  # source 1 on (benchmarks/jump_forward.py turns it off)

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
