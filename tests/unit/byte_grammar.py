"""Shared by the grammar unit tests: xgrammar over the tiny byte-level vocabulary (256 bytes,
<s>, </s>), and the set of tokens a matcher allows next."""

from __future__ import annotations

import torch

from engine.loading.tiny import VOCAB, byte_tokenizer
from engine.structured.xgrammar_backend import XGrammarBackend

EOS = 257


def byte_backend() -> tuple[object, XGrammarBackend]:
    """``(tokenizer, backend)`` for the byte vocabulary, EOS the stop token."""
    tok = byte_tokenizer()
    return tok, XGrammarBackend(tok, VOCAB, [EOS])


def allowed(backend, matcher) -> set[int]:
    bm = backend.allocate_bitmask(1)
    backend.fill_bitmasks([matcher], bm, [0])
    logits = torch.zeros(1, VOCAB)
    backend.apply_bitmask(logits, bm, [0])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
