"""Shared by the grammar unit tests: xgrammar over the tiny byte-level vocabulary (256 bytes,
<s>, </s>), and the set of tokens a matcher allows next.

Fixtures (imported by the conftest.py of tests/engine/structured/ and tests/server/tools/): ``tok``
is the tiny byte-level tokenizer and ``backend`` xgrammar over its vocabulary, EOS the stop token.
Built once per session and folder (a test that parametrizes ``backend`` itself is unaffected)."""

from __future__ import annotations

import pytest
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


@pytest.fixture(scope="session")
def _byte_grammar():
    return byte_backend()


@pytest.fixture(scope="session")
def tok(_byte_grammar):
    return _byte_grammar[0]


@pytest.fixture(scope="session")
def backend(_byte_grammar):
    return _byte_grammar[1]
