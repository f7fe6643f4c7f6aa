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

    init = gguf.GGUFReader.__init__

    def counting(self, *args, **kwargs):  # every reader, kvserve's subclass included
        opened.append(args[0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    with LLM(str(path), max_model_len=64, cpu_probe="off") as llm:
        assert llm.engine.runner.quantized
    assert len(opened) == 1, opened


def test_the_fast_reader_reads_what_gguf_py_reads(tmp_path):
    """kvserve's reader (a plain view of the memory map under gguf-py's parser) gives the same
    fields, contents and tensors as gguf-py's own."""
    import numpy as np

    path = tmp_path / "tiny.Q4.gguf"
    _make_llama_gguf(path, tied=True, quantised=True)
    ours, theirs = gguf_reader(path), gguf.GGUFReader(str(path))
    release_gguf_readers()
    assert type(ours) is not gguf.GGUFReader and isinstance(ours, gguf.GGUFReader)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types and ours.fields[key].data == field.data
        assert [(p.dtype, p.tobytes()) for p in ours.fields[key].parts] == \
            [(p.dtype, p.tobytes()) for p in field.parts], key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(np.asarray(a.data), np.asarray(b.data))
               for a, b in zip(ours.tensors, theirs.tensors))
