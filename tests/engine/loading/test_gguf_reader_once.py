"""A start parses its GGUF once (``engine.loading.gguf_fields.gguf_reader``): gguf-py's reader
parses every metadata field on open (seconds for a real tokenizer), and loading reads the same
file for its tensors, pooling type, sampling defaults and chat template."""

from __future__ import annotations

import os

import gguf

from engine.llm import LLM
from engine.loading.gguf_fields import gguf_reader, release_gguf_readers
from tests.support.tiny_models import _make_llama_gguf


def test_the_reader_is_kept_per_file_until_the_file_changes_or_is_released(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _make_llama_gguf(a, tied=True, quantised=True)
    _make_llama_gguf(b, tied=True)
    first = gguf_reader(a)
    assert gguf_reader(str(a)) is first
    assert gguf_reader(b) is not first and gguf_reader(a) is not first  # one file at a time
    again = gguf_reader(a)
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # rewritten: parsed again
    assert gguf_reader(a) is not again
    kept = gguf_reader(a)
    release_gguf_readers()
    assert gguf_reader(a) is not kept
    release_gguf_readers()


def test_an_engine_start_parses_its_gguf_once(tmp_path, monkeypatch):
    path = tmp_path / "tiny.Q4.gguf"
    _make_llama_gguf(path, tied=True, quantised=True)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with LLM(str(path), max_model_len=64, cpu_probe="off"):
        pass  # converts (transformers reads the file too, with its own reader)
    opened = []

    class Counting(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    with LLM(str(path), max_model_len=64, cpu_probe="off") as llm:
        assert llm.engine.runner.quantized
    assert len(opened) == 1, opened
