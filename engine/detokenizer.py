"""Incremental detokenization: text of one generated token at a time, in O(window) per token.

Decoding a single token on its own is wrong for two reasons: a UTF-8 character may be split
across byte-level tokens (alone, each half decodes to U+FFFD), and SentencePiece-style decoders
drop the leading space of the first token they see. So, like vLLM and HF's TextStreamer, each
step decodes a small window of recent tokens twice — ``ids[prefix:]`` and ``ids[prefix:read]`` —
and emits the difference. The window moves forward every time text is emitted, so its length
stays small (a few tokens) whatever the length of the sequence. Text ending in U+FFFD is held
back until the character completes; ``flush()`` releases whatever is left when the sequence ends.

Contract: the concatenation of everything ``add_token`` and ``flush`` return equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers, and
``decode(prompt + output)`` minus ``decode(prompt)`` for SentencePiece ones (where the first
output token's leading space is real text), provided the decoder is prefix-stable (every decoder
of the Llama/Qwen/Mistral/GPT-2 families is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens give the first output token its context (vLLM uses the same).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def _make_decode(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """The fastest ``ids -> str`` that agrees with ``tokenizer.decode``.

    A HF fast tokenizer without clean-up decodes in Rust; calling its backend directly skips
    ~7 µs of Python wrapping per call. Anything else goes through ``tokenizer.decode``.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "decode")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        def decode(ids: Sequence[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return decode

    def decode_slow(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)
    return decode_slow


def token_text_fn(tokenizer: Any):
    """``id -> str`` giving one token's own text (for ``Logprob.decoded_token``), vLLM-style."""
    def token_text(token_id: int) -> str:
        toks = tokenizer.convert_ids_to_tokens([token_id])
        return tokenizer.convert_tokens_to_string(toks)
    return token_text


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    ``add_token`` returns the text that became certain with this token ("" while a multi-byte
    character is incomplete). State is the token list and two offsets; nothing else grows.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._decode = _make_decode(tokenizer, skip_special_tokens,
                                    spaces_between_special_tokens)
        # Only the tail of the prompt is ever decoded again: keep just that.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # decode(ids[prefix:read]), cached until the offsets move.
        self._prefix_text: str | None = self._decode(self._ids) if self._ids else ""
        if self._prefix_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: the output's first bytes would complete it,
            # and text belonging to the prompt would vanish from the diff. Decode the output
            # on its own instead (a stray continuation byte shows as U+FFFD, as decode gives).
            self._ids, self._read_offset, self._prefix_text = [], 0, ""

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly decoded text (possibly "")."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character: U+FFFD, as ``decode`` would give)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            # Nothing certain yet: a character is incomplete, or the token added no text
            # (a skipped special token). Keep the window; it stays short because the next
            # complete character moves it.
            if len(new_text) <= len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                self._skip_empty()
            return ""
        delta = new_text[len(prefix_text):]
        self._advance()
        return delta

    def _advance(self) -> None:
        """Everything decoded so far is emitted: the new window starts at the old read point."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._compact()

    def _skip_empty(self) -> None:
        """Tokens that decoded to nothing (e.g. skipped specials) are absorbed into the window's
        read point so that a long run of them does not make the window grow."""
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._compact()

    def _compact(self) -> None:
        # Drop ids before the window so that memory stays O(window) too.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
