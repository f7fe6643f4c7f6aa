"""Fixtures of the grammar unit tests (tests/unit/byte_grammar.py): ``tok`` is the tiny
byte-level tokenizer and ``backend`` xgrammar over its vocabulary, EOS the stop token. Built once
per session (a test that parametrizes ``backend`` itself is unaffected)."""

from __future__ import annotations

import pytest

from tests.unit.byte_grammar import byte_backend


@pytest.fixture(scope="session")
def _byte_grammar():
    return byte_backend()


@pytest.fixture(scope="session")
def tok(_byte_grammar):
    return _byte_grammar[0]


@pytest.fixture(scope="session")
def backend(_byte_grammar):
    return _byte_grammar[1]
