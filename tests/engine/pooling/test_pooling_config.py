"""Where a model's pooling rule is read from (engine.pooling.model_config, .serving)."""

from __future__ import annotations

import json

import gguf
import pytest

from engine.pooling.model_config import read_model_pooling
from engine.pooling.serving import resolve_task


def _gguf(path, pooling_type: int | None):
    w = gguf.GGUFWriter(str(path), "qwen3")
    if pooling_type is not None:
        w.add_uint32("qwen3.pooling_type", pooling_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("value,method", [(1, "mean"), (2, "cls"), (3, "last")])
def test_gguf_pooling_type(tmp_path, value, method):
    rule = read_model_pooling(tmp_path, "embed", _gguf(tmp_path / "m.gguf", value))
    assert (rule.method, rule.normalize) == (method, True)


def test_defaults_and_sentence_transformers(tmp_path):
    assert read_model_pooling(tmp_path, "embed", _gguf(tmp_path / "m.gguf", None)).method == "last"
    assert read_model_pooling(tmp_path, "generate").method == "mean"
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    rule = read_model_pooling(tmp_path, "generate")
    assert (rule.method, rule.normalize) == ("cls", False)  # no Normalize module


class _Cfg:
    architectures = ["Qwen3ForCausalLM"]


def test_resolve_task(tmp_path):
    assert resolve_task("auto", tmp_path, _Cfg(), "Qwen3-Reranker-0.6B") == "score"
    assert resolve_task("auto", tmp_path, _Cfg(), "Qwen3-Embedding-0.6B") == "embed"
    assert resolve_task("auto", tmp_path, _Cfg(), "SmolLM2") == "generate"
    assert resolve_task("embed", tmp_path, _Cfg(), "SmolLM2") == "embed"
