"""Fixtures of the grammar tests: ``tok`` (the tiny byte-level tokenizer) and ``backend``
(xgrammar over its vocabulary), from tests/support/byte_grammar.py."""

from tests.support.byte_grammar import _byte_grammar, backend, tok  # noqa: F401
