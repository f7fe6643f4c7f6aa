"""A model cache that cannot be written (issue 27, item 6): one warning line naming the
directory and $KVSERVE_CACHE_DIR, and the GGUF served directly (weights read from it at load)
instead of a raw traceback. Uses the tiny F32 GGUF of tests/support/tiny_models.py."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from engine.loading import gguf_convert
from engine.loading.cache_fallback import cache_write_error
from engine.loading.loader import iter_weights, resolve_model


def _same_weights(files, model) -> None:
    weights = dict(iter_weights(files))
    expected = model.state_dict()
    assert set(weights) == set(expected) - {"lm_head.weight"}  # tied: not stored
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def _one_warning(caplog, cache) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert str(cache) in lines[0] and "KVSERVE_CACHE_DIR" in lines[0]
    return lines[0]


def test_an_unwritable_cache_serves_the_gguf_directly(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = blocker / "cache"  # mkdir fails: ENOTDIR, as a read-only mount fails with EROFS
    with caplog.at_level(logging.WARNING, logger="kvserve.loader"):
        files = resolve_model(str(tiny_gguf[0]), cache_dir=cache, progress=False)
    assert "Not a directory" in _one_warning(caplog, cache)
    assert files.source == "gguf" and not str(files.path).startswith(str(tmp_path))
    # No weights were written: every tensor is read (dequantised) from the GGUF.
    assert sum(p.stat().st_size for p in files.path.glob("*.safetensors")) < 1024
    _same_weights(files, tiny_gguf[1])


def test_a_full_disk_while_converting_falls_back_too(tiny_gguf, tmp_path, monkeypatch, caplog):
    real = gguf_convert._write_weights_streaming

    def disk_full(gguf_path, config, out_dir, **kwargs):
        if not kwargs.get("all_in_gguf"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(gguf_path, config, out_dir, **kwargs)

    monkeypatch.setattr(gguf_convert, "_write_weights_streaming", disk_full)
    with caplog.at_level(logging.WARNING, logger="kvserve.loader"):
        files = resolve_model(str(tiny_gguf[0]), cache_dir=tmp_path, progress=False)
    assert "No space left on device" in _one_warning(caplog, tmp_path)
    models = tmp_path / "models"  # nothing half-written stays in the cache
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    _same_weights(files, tiny_gguf[1])


def test_only_cache_write_failures_are_handled(tiny_gguf, tmp_path, monkeypatch):
    assert cache_write_error(OSError(errno.EROFS, "Read-only file system")) \
        == "Read-only file system"
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull,"
                           " message: \"No space left on device\" })")
    assert cache_write_error(wrapped) is not None  # safetensors' writer: the OS error as text
    assert cache_write_error(ValueError("cannot convert: unknown architecture")) is None

    def unreadable(*args, **kwargs):
        raise ValueError("cannot convert x.gguf: transformers' GGUF reader failed")

    monkeypatch.setattr(gguf_convert, "_write_weights_streaming", unreadable)
    with pytest.raises(ValueError, match="GGUF reader failed"):
        resolve_model(str(tiny_gguf[0]), cache_dir=tmp_path, progress=False)
