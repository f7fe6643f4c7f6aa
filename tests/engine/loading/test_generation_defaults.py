"""The model's sampling defaults (``--generation-config``): read from generation_config.json, a
GGUF's ``general.sampling.*``, or the embedded model's card; a request's own values win."""

from __future__ import annotations

import json

import pytest

from engine.loading.generation_defaults import (
    EMBEDDED_MODEL_CARD,
    GenerationDefaults,
    generation_defaults,
    gguf_sampling,
)
from server.protocol import ChatCompletionRequest


def _model_dir(tmp_path, **config):
    d = tmp_path / "model"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **config}))
    return d


def test_auto_takes_the_models_generation_config(tmp_path):
    d = _model_dir(tmp_path, temperature=0.6, top_p=0.95, top_k=20, do_sample=True)
    got = generation_defaults(d, "auto")
    assert got.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert "generation_config.json" in got.describe()


def test_the_embedded_model_falls_back_to_its_card_and_vllm_turns_it_off(tmp_path):
    d = _model_dir(tmp_path)
    assert generation_defaults(d, "auto").values == {}
    assert generation_defaults(d, "auto", embedded=True).values == EMBEDDED_MODEL_CARD
    assert generation_defaults(d, "vllm", embedded=True).values == {}


def test_a_directory_setting_and_its_errors(tmp_path):
    d = _model_dir(tmp_path, repetition_penalty=1.1)
    assert generation_defaults(tmp_path / "elsewhere", str(d)).values == {
        "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(d, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="top_p"):
        GenerationDefaults({"top_p": 1.5}, "x")


def test_gguf_sampling_keys_are_read(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "s.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.7)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 0.8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = gguf_sampling(gguf.GGUFReader(str(path)))
    assert got == {"temperature": pytest.approx(0.7), "top_k": 40, "top_p": pytest.approx(0.8)}


def test_defaults_fill_only_what_the_request_left_out():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 20}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    p = req.sampling_params(max_tokens=8, logprobs=None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.5, 20)
    greedy = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert greedy.sampling_params(max_tokens=8, logprobs=None,
                                  defaults=defaults).temperature == 0.0
    plain = req.sampling_params(max_tokens=8, logprobs=None)
    assert (plain.temperature, plain.top_k) == (1.0, -1)  # OpenAI's defaults without any
