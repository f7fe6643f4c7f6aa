"""Issue 66, item 3: one conversion per GGUF file's content, and ``kvserve cache ls|prune``.

The conversion cache was keyed by the file's resolved path and mtime: four venvs holding the same
98 MB file made four 517 MB copies. It is keyed by the content (size, head and sampled bytes)
and the converter's format now; ``kvserve cache`` lists and prunes it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from engine.loading import gguf_convert
from engine.loading.loader import resolve_model
from server.cli import main
from tests.support.tiny_models import _make_llama_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("first-hour-gguf") / "tiny-llama.F32.gguf"
    _make_llama_gguf(path, tied=True)
    return path


def _models(cache):
    return sorted(p.name for p in (cache / "models").iterdir()
                  if p.is_dir() and not p.name.startswith("."))


def test_the_same_file_from_two_paths_is_converted_once(gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    venv_a, venv_b = tmp_path / "venv-a", tmp_path / "venv-b"
    for venv in (venv_a, venv_b):
        venv.mkdir()
    first = shutil.copy2(gguf, venv_a / gguf.name)
    second = shutil.copy(gguf, venv_b / gguf.name)  # another path, another mtime
    renamed = shutil.copy(gguf, venv_b / "renamed.gguf")
    files = resolve_model(str(first), cache_dir=cache, progress=False)
    assert gguf_convert.is_complete(files.path)
    marker = json.loads((files.path / gguf_convert.MARKER).read_text())
    assert marker["format"] == gguf_convert.CONVERSION_FORMAT
    assert files.path.name.endswith(marker["key"])

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert resolve_model(str(second), cache_dir=cache).path == files.path
    assert resolve_model(str(renamed), cache_dir=cache).path == files.path
    assert _models(cache) == [files.path.name]
    # The first path gone: the entry now names a file that is still there.
    os.unlink(first)
    assert resolve_model(str(second), cache_dir=cache).path == files.path
    source = json.loads((files.path / gguf_convert.MARKER).read_text())["source"]
    assert source == str(Path(second).resolve())


def test_the_key_reads_the_content_not_the_path_nor_the_mtime(gguf, tmp_path):
    copy = shutil.copy(gguf, tmp_path / "x.gguf")
    os.utime(copy, (1, 1))
    assert gguf_convert.cache_key(gguf) == gguf_convert.cache_key(copy)
    data = bytearray(open(copy, "rb").read())
    data[-10] ^= 0x01  # a weight's byte, near the end: the sampled slices cover it
    with open(copy, "wb") as f:
        f.write(bytes(data))
    assert gguf_convert.cache_key(gguf) != gguf_convert.cache_key(copy)


def test_cache_ls_and_prune(gguf, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    files = resolve_model(str(gguf), cache_dir=cache, progress=False)
    stale = cache / "models" / "old-model-0123456789abcdef"  # an older kvserve's conversion
    stale.mkdir()
    (stale / gguf_convert.MARKER).write_text(json.dumps({"format": 3, "source": "/x.gguf"}))
    (stale / "model.safetensors").write_bytes(b"x" * 5000)
    leftover = cache / "models" / f".{files.path.name}.tmp-dead"
    leftover.mkdir()
    (cache / "quant-probe").mkdir()
    (cache / "quant-probe" / "v.json").write_text("{}")

    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and files.path.name in out and f"<- {gguf}" in out
    assert "stale model" in out and "leftover" in out and "quant-probe/" in out
    assert "min ago" in out and "KB" in out

    assert main(["cache", "prune", "--dry-run"]) == 0
    assert "would remove 2 item(s)" in capsys.readouterr().out and stale.exists()
    assert main(["cache", "prune"]) == 0  # no option: what this kvserve cannot use
    out = capsys.readouterr().out
    assert "removed 2 item(s)" in out
    assert not stale.exists() and not leftover.exists() and files.path.exists()

    assert main(["cache", "prune", "--older-than", "30"]) == 0  # used just now: kept
    assert "removed 0 item(s)" in capsys.readouterr().out and files.path.exists()
    long_ago = time.time() - 40 * 86400
    os.utime(files.path / gguf_convert.LAST_USE, (long_ago, long_ago))
    assert main(["cache", "prune", "--older-than", "30"]) == 0
    assert "removed 1 item(s)" in capsys.readouterr().out and not files.path.exists()

    resolve_model(str(gguf), cache_dir=cache, progress=False)
    assert main(["cache", "prune", "--all"]) == 0
    assert "removed 1 item(s)" in capsys.readouterr().out
    assert _models(cache) == [] and (cache / "quant-probe" / "v.json").exists()
