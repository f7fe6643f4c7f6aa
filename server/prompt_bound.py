"""Refusing a text prompt that cannot fit the context by its length in characters, before it is
tokenised, and handing the tokeniser's peak buffers back to the OS after a large one.

Tokenising costs time and memory in proportion to the text (docs/decisions.md#prompt-length-bound),
while a prompt far beyond ``max_model_len`` is a 400 anyway. The bound is proven, never a guess:
no token of the vocabulary (added ones included) spells more than ``L`` characters, ``L`` the
longest token in the vocabulary's own spelling, so a text of ``N`` characters has at least
``ceil(N / L)`` tokens and one above ``max_model_len * L`` characters surely does not fit
(:meth:`PromptBound.check` refuses it). This holds only while the tokenizer keeps every
character: :func:`prompt_bound` gives a bound only for a fast tokenizer whose normalizer,
pre-tokenizer and model never drop or merge text; for any other it gives None and nothing is
refused by length (the engine's token count still is).

Templates only add text, so a chat prompt is checked after rendering, before tokenising."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from server.errors import APIError

logger = logging.getLogger("kvserve.server")

# After tokenising a text this long, return the freed heap to the OS (glibc ``malloc_trim``):
# the tokeniser's buffers for it are freed in a worker thread's arena, which glibc keeps.
TRIM_AFTER_CHARS = 256 * 1024

_SAFE_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation",
                                  "UnicodeScripts"})


@dataclass(frozen=True)
class PromptBound:
    """``longest_token_chars`` (``L`` above) and the context length it bounds prompts for."""

    longest_token_chars: int
    max_model_len: int

    @property
    def max_chars(self) -> int:
        """The longest text that may fit: ``max_model_len * L`` characters."""
        return self.max_model_len * self.longest_token_chars

    def check(self, chars: int, param: str) -> None:
        """400 naming ``param`` when a text of ``chars`` characters surely has more tokens than
        ``max_model_len``."""
        if chars > self.max_chars:
            least = -(-chars // self.longest_token_chars)
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the prompt has {chars} characters, so at least {least} tokens (no token of "
                f"this tokenizer is longer than {self.longest_token_chars} characters). "
                f"Please reduce the prompt.", param=param, code="context_length_exceeded")


def check_chars(bound: PromptBound | None, chars: int, param: str) -> None:
    """:meth:`PromptBound.check`, or nothing when the tokenizer has no proven bound."""
    if bound is not None:
        bound.check(chars, param)


def prompt_bound(tokenizer: Any, max_model_len: int) -> PromptBound | None:
    """The bound for ``tokenizer`` (see the module docstring), or None when it cannot be
    proven for it (a slow tokenizer, a normalizer that may drop text, ...). Never raises.

    ``L`` is the longest token in the vocabulary's own spelling: byte-level BPE spells one byte
    per character (at least one byte per text character), SentencePiece's ``▁`` one space,
    byte-fallback pieces ``<0xAB>`` six characters for one byte. A bound is given only for a
    fast tokenizer with no normalizer or only expanding ones, byte-level, Metaspace or splitting
    pre-tokenizers that keep what they split on, and BPE or Unigram without fused unknowns."""
    try:
        longest = longest_token_chars(tokenizer)
    except Exception as exc:  # noqa: BLE001 - any surprise means: no bound
        logger.info("prompts are not refused by length before tokenising (%s)", exc)
        return None
    if longest is None:
        return None
    return PromptBound(longest, max_model_len)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The longest spelling, in characters, of any token of a fast tokenizer that keeps every
    character of its input; None for any other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    why = _drops_text(spec)
    if why:
        logger.info("prompts are not refused by length before tokenising: the tokenizer's %s",
                    why)
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return max([len(t) for t in vocab] + [len(str(t)) for t in added.values()] + [1])


def _drops_text(spec: dict[str, Any]) -> str | None:
    """Why a tokenizer (its JSON spec) may spell a text in fewer tokens than its characters
    divided by its longest token, or None when it cannot."""
    norm = _bad_part(spec.get("normalizer"), "normalizers", _safe_normalizer)
    if norm:
        return f"normalizer {norm} may drop or merge characters"
    stripping = [t.get("content") for t in spec.get("added_tokens") or []
                 if t.get("lstrip") or t.get("rstrip")]
    if stripping:
        return f"added token {stripping[0]!r} absorbs the whitespace beside it"
    pre = _bad_part(spec.get("pre_tokenizer"), "pretokenizers", _safe_pre_tokenizer)
    if pre:
        return f"pre-tokenizer {pre} may drop characters"
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE" and (not model.get("fuse_unk") or model.get("byte_fallback")):
        return None
    if kind == "Unigram" and model.get("byte_fallback"):
        return None
    return f"model {kind} may spell many characters as one unknown token"


def _bad_part(part: dict[str, Any] | None, children: str, safe) -> str | None:
    if part is None:
        return None
    if part.get("type") == "Sequence":
        return next((bad for p in part.get(children, []) if (bad := _bad_part(p, children,
                                                                                safe))), None)
    return None if safe(part) else str(part.get("type"))


def _safe_normalizer(part: dict[str, Any]) -> bool:
    if part.get("type") == "Replace":  # a literal replaced by one at least as long
        pattern, content = part.get("pattern") or {}, part.get("content") or ""
        return "String" in pattern and len(content) >= len(pattern["String"])
    return part.get("type") in _SAFE_NORMALIZERS


def _safe_pre_tokenizer(part: dict[str, Any]) -> bool:
    if part.get("type") in ("Split", "Punctuation"):
        return part.get("behavior") != "Removed"
    return part.get("type") in _SAFE_PRE_TOKENIZERS


def release_after(chars: int) -> None:
    """Hand freed heap back to the OS after tokenising ``chars`` characters, when that many
    (:data:`TRIM_AFTER_CHARS`) may have left megabytes in the calling thread's arena."""
    if chars >= TRIM_AFTER_CHARS:
        trim = _malloc_trim()
        if trim is not None:
            trim(0)


async def released_after(chars: int) -> None:
    """:func:`release_after` on a worker thread (it walks every arena), when it has work."""
    if chars >= TRIM_AFTER_CHARS:
        await asyncio.to_thread(release_after, chars)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
