"""Fixtures of the engine tests (tests/support/tiny_models.py): ``smollm2_files`` (the embedded
model as a local HF directory), ``tiny_llama``, ``make_llama_gguf`` and ``tiny_gguf`` (a tiny
random Llama, and the same model written as a GGUF)."""

from tests.support.tiny_models import (  # noqa: F401
    make_llama_gguf,
    smollm2_files,
    tiny_gguf,
    tiny_llama,
)
