"""Incremental detokenization: text of one generated token at a time, in O(window) per token.

A token decoded alone can be wrong (a UTF-8 character split across byte-level tokens;
SentencePiece decoders dropping the first token's leading space), so, like vLLM and HF's
TextStreamer, each step decodes a small window of recent tokens twice (``ids[prefix:]`` and
``ids[prefix:read]``) and emits the difference; the window moves forward with every emission.
Text ending in U+FFFD is held back until the character completes; ``flush()`` releases the rest.

Contract: the concatenation of everything ``add_token`` and ``flush`` return equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers, and
``decode(prompt + output)`` minus ``decode(prompt)`` for SentencePiece ones, provided the decoder
is prefix-stable (appending tokens never changes text decoded before): the Llama/Qwen/Mistral/
GPT-2 families' are, except for byte-fallback tokens forming invalid UTF-8, which
``ByteFallback`` turns into U+FFFD retroactively."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens give the first output token its context (vLLM uses the same).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
_MAX_CHAR_BYTES = 4  # a UTF-8 character spans at most 4 byte tokens


def _make_decode(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """The fastest ``ids -> str`` that agrees with ``tokenizer.decode``.

    A HF fast tokenizer without clean-up decodes in Rust; calling its backend directly skips
    the Python wrapping of each call (docs/decisions.md#small-cpu-costs). Anything else goes
    through ``tokenizer.decode``.
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
    """``id -> str`` giving one token's own text (for ``Logprob.decoded_token``), vLLM-style.

    Never raises for an id the tokenizer does not know (a model whose embedding is padded past
    the tokenizer, e.g. Qwen2/Qwen3, can still score or emit one): its text is "".
    """
    def token_text(token_id: int) -> str:
        try:
            toks = tokenizer.convert_ids_to_tokens([token_id])
            if not toks or toks[0] is None:
                return ""
            return tokenizer.convert_tokens_to_string(toks)
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):
            return ""
    return token_text


def tokenizer_size(tokenizer: Any) -> int:
    """One past the largest token id the tokenizer knows (added tokens included): ids from
    here up to the model's vocabulary size exist in the embedding but decode to nothing."""
    size = len(tokenizer)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is not None:
        ids = get_vocab().values()
        if ids:
            size = max(size, max(ids) + 1)
    return size


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    ``add_token`` returns the text that became certain with this token ("" while a multi-byte
    character is incomplete). State: the recent token ids and two offsets into them. The decoded
    window spans from the previous emission to now: a few tokens, more only during a run of
    tokens that decode to nothing (skipped specials).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._decode = _make_decode(tokenizer, skip_special_tokens,
                                    spaces_between_special_tokens)
        # Only the tail of the prompt is ever decoded again: keep just that.
        self._ids, self._prefix_text = self._prompt_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # A prompt whose text ends in U+FFFD: a real U+FFFD character, or one the output's
        # first bytes complete. Decided at the first decode (``_settle_prompt``).
        self._unsure_prompt = self._prefix_text.endswith(_REPLACEMENT)

    def _prompt_context(self, prompt: list[int]) -> tuple[list[int], str]:
        """The last few prompt tokens and their text, the window starting on a whole character.

        A window that starts inside a character decodes to U+FFFD (byte fallback even turns the
        whole byte run into U+FFFD), so it is widened until its text ends cleanly. If the prompt
        itself ends in U+FFFD, that is a real U+FFFD character or a character the output's first
        bytes complete; ``_settle_prompt`` tells which once output is there.
        """
        if not prompt:
            return [], ""
        for width in range(_PROMPT_CONTEXT, _PROMPT_CONTEXT + _MAX_CHAR_BYTES + 1):
            context = prompt[-width:]
            text = self._decode(context)
            if not text.endswith(_REPLACEMENT) or width >= len(prompt):
                break
        return context, text

    def _settle_prompt(self, new_text: str) -> str:
        """First decode that adds text (or the flush) after a prompt ending in U+FFFD. The context stays when
        the output's text after it is the output's own text, up to the leading space that only
        the context gives (a real U+FFFD character ended the prompt). Otherwise the output's
        bytes joined or completed a character the prompt ended inside of, and the diff would
        mangle them: the context is dropped and the output decoded on its own (a stray
        continuation byte shows as U+FFFD, as ``decode`` of the output gives). Returns the
        window's new text."""
        self._unsure_prompt = False
        alone = self._decode(self._ids[self._read_offset:])
        prefix = self._prefix_text
        if new_text.startswith(prefix) and new_text[len(prefix):].lstrip(" ") == alone.lstrip(" "):
            return new_text
        del self._ids[:self._read_offset]
        self._prefix_offset = self._read_offset = 0
        self._prefix_text = ""
        return alone

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
        new_text = self._decode(self._ids[self._prefix_offset:])
        if self._unsure_prompt and (final or new_text != self._prefix_text):
            new_text = self._settle_prompt(new_text)
        prefix_text = self._prefix_text
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            # Nothing certain yet: a character is incomplete (keep the window as it is), or the
            # token added no text, e.g. a skipped special (move the read point past it but keep
            # the window's start, whose text gives the next token its context).
            if len(new_text) <= len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                self._read_offset = len(self._ids)
                self._prefix_text = new_text
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

    def _compact(self) -> None:
        # Drop ids before the window so that memory stays O(window) too.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
