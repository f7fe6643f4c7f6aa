"""Adapter files: PEFT directories and llama.cpp LoRA GGUFs read into ``LoRAAdapter``.

The reference is PEFT itself: for each (layer, target) ``scaling * B @ A`` must equal
``merged_weight - base_weight`` after ``merge_and_unload()``. The GGUF files are written here
the way llama.cpp's ``convert_lora_to_gguf.py`` writes them (A as ``lora_a``, B as ``lora_b``,
no transpose, the Q/K rows of B permuted for llama) from the same PEFT weights, and must read
back to the same deltas.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config.lora import parse_lora_modules
from engine.loading.tiny import make_tiny_model_dir
from engine.loading.tiny_gguf import llama_cpp_permute
from engine.lora.adapter import TARGETS, LoRAAdapter
from engine.lora.gguf_format import GGUF_TARGETS, read_gguf_lora
from engine.lora.load import load_adapter
from engine.lora.peft_format import read_peft_dir

HEADS, KV_HEADS, LAYERS = 4, 2, 2
PROJ = {hf: gg for gg, hf in GGUF_TARGETS.items()}
GROUP = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
         for t in TARGETS}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("base") / "llama", "llama",
                               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                               num_hidden_layers=LAYERS)


def make_peft(base_dir: Path, out: Path, seed: int = 1, safe: bool = True, **lora):
    """Save a random PEFT adapter of the tiny Llama at ``out``; return PEFT's merged deltas
    {(layer, target): merged - base}."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    config = LoraConfig(**{"target_modules": list(TARGETS), "r": 4, "lora_alpha": 8,
                           "init_lora_weights": False, **lora})
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=safe)
    merged = peft_model.merge_and_unload().state_dict()
    return {(layer, t): merged[key] - base[key]
            for layer in range(LAYERS) for t in TARGETS
            if not torch.equal(merged[key := f"model.layers.{layer}.{GROUP[t]}.{t}.weight"],
                               base[key])}


def deltas(adapter: LoRAAdapter) -> dict[tuple[int, str], torch.Tensor]:
    return {k: adapter.scaling * b @ a for k, (a, b) in adapter.weights.items()}


def assert_deltas(adapter: LoRAAdapter, expected: dict, atol: float = 1e-5) -> None:
    got = deltas(adapter)
    assert set(got) == set(expected)
    for key, delta in expected.items():
        torch.testing.assert_close(got[key], delta, atol=atol, rtol=0, msg=str(key))


@pytest.fixture(scope="module")
def plain(base_dir, tmp_path_factory):
    """(directory, deltas) of an r=4, alpha=8 adapter on all seven targets."""
    out = tmp_path_factory.mktemp("plain") / "adapter"
    return out, make_peft(base_dir, out)


def test_peft_plain(plain):
    path, expected = plain
    adapter = read_peft_dir("plain", path)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert len(expected) == LAYERS * len(TARGETS)
    assert adapter.targets == TARGETS
    assert_deltas(adapter, expected)


@pytest.mark.parametrize("lora", [
    {"use_rslora": True},
    {"rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 8}},
    {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 32, "up_proj": 3}},
    {"target_modules": ["q_proj", "v_proj"], "r": 8, "lora_alpha": 16, "use_rslora": True},
], ids=["rslora", "rank_pattern", "alpha_pattern", "qv"])
def test_peft_variants(base_dir, tmp_path, lora):
    expected = make_peft(base_dir, tmp_path / "a", **lora)
    adapter = read_peft_dir("v", tmp_path / "a")
    assert_deltas(adapter, expected)
    if "rank_pattern" in lora:  # per-module scales folded into B
        assert adapter.scaling == 1.0
        assert adapter.weights[(0, "q_proj")][0].shape[0] == 2
    if lora.get("use_rslora") and "r" not in lora:
        assert adapter.scaling == pytest.approx(8 / 2)


def test_peft_bin_and_key_spellings(base_dir, plain, tmp_path):
    path, expected = plain
    reference = read_peft_dir("a", path)
    # adapter_model.bin (torch.save), as PEFT writes without safe_serialization
    binary = make_peft(base_dir, tmp_path / "bin", safe=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    assert_deltas(read_peft_dir("b", tmp_path / "bin"), binary)
    # keys without base_model.model., and with .default: the same adapter
    for i, rename in enumerate([lambda k: k.removeprefix("base_model.model."),
                                lambda k: k.replace(".weight", ".default.weight")]):
        copy = tmp_path / f"keys{i}"
        shutil.copytree(path, copy)
        tensors = load_file(copy / "adapter_model.safetensors")
        save_file({rename(k): v for k, v in tensors.items()}, copy / "adapter_model.safetensors")
        assert read_peft_dir("c", copy).fingerprint == reference.fingerprint
    # fan_in_fan_out only describes a Conv1D base weight: the factors read the same
    copy = tmp_path / "fifo"
    shutil.copytree(path, copy)
    edit_config(copy, fan_in_fan_out=True,  # and a target named by its end, as PEFT allows
                target_modules=["self_attn.q_proj", *TARGETS[1:]])
    assert read_peft_dir("d", copy).fingerprint == reference.fingerprint


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0B = Q0A.replace("lora_A", "lora_B")


@pytest.mark.parametrize("change, message", [
    (lambda p: edit_config(p, use_dora=True), "DoRA"),
    (lambda p: edit_config(p, bias="lora_only"), "bias"),
    (lambda p: edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda p: edit_config(p, target_modules=[*TARGETS, "lm_head"]), "lm_head"),
    (lambda p: edit_config(p, peft_type="IA3"), "IA3"),
    (lambda p: edit_config(p, alora_invocation_tokens=[5, 6]), "activated LoRA"),
    (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    (lambda p: edit_tensors(p, lambda t: t.pop(Q0B)), "lora_A but no lora_B"),
    (lambda p: edit_tensors(p, lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
         "base_model.model.lm_head.lora_B.weight": torch.zeros(260, 4)})), "lm_head"),
    (lambda p: edit_tensors(p, lambda t: t.update(
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 260)})),
     "embed"),
    (lambda p: edit_tensors(p, lambda t: t.update(
        {Q0A.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(64)})), "DoRA"),
    (lambda p: edit_tensors(p, lambda t: t.update({Q0A: t[Q0A][:2]})), "rank 2"),
    (lambda p: edit_tensors(p, lambda t: t.clear()), "no LoRA tensors"),
], ids=["dora", "bias", "modules_to_save", "lm_head_target", "peft_type", "alora",
        "no_config", "no_weights", "a_without_b", "lm_head_weights", "embedding",
        "magnitude", "rank_mismatch", "empty"])
def test_peft_refusals(plain, tmp_path, change, message):
    copy = tmp_path / "bad"
    shutil.copytree(plain[0], copy)
    change(copy)
    with pytest.raises(ValueError, match=message):
        read_peft_dir("bad", copy)


def test_peft_refuses_real_lm_head_adapter(base_dir, tmp_path):
    make_peft(base_dir, tmp_path / "a", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        read_peft_dir("x", tmp_path / "a")


def write_lora_gguf(path: Path, adapter: LoRAAdapter, alpha: float, arch: str = "llama",
                    a_type: str = "F32", b_type: str = "F32", **extra) -> None:
    """``adapter``'s pairs as llama.cpp's convert_lora_to_gguf.py writes them."""
    w = gguf.GGUFWriter(path, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, extra.pop("adapter_type", "lora"))
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        b = b.numpy()
        if arch == "llama" and target in ("q_proj", "k_proj"):
            b = llama_cpp_permute(b, HEADS if target == "q_proj" else KV_HEADS)
        name = f"blk.{layer}.{PROJ[target]}.weight"
        for suffix, t, qtype in (("lora_a", a.numpy(), a_type), ("lora_b", b, b_type)):
            add(w, f"{name}.{suffix}", np.ascontiguousarray(t, dtype=np.float32), qtype)
    for name, (t, qtype) in extra.pop("tensors", {}).items():
        add(w, name, t, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add(w, name: str, t: np.ndarray, qtype: str) -> None:
    q = gguf.GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16"):
        w.add_tensor(name, gguf.quants.quantize(t, q))
    else:
        w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_peft(plain, tmp_path, arch):
    peft = read_peft_dir("p", plain[0])
    write_lora_gguf(tmp_path / "a.gguf", peft, alpha=8.0, arch=arch)
    adapter = read_gguf_lora("g", tmp_path / "a.gguf", num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.fingerprint == peft.fingerprint  # bit-equal weights and scale
    assert_deltas(adapter, plain[1])


def test_gguf_permutation_is_undone_not_ignored(plain, tmp_path):
    peft = read_peft_dir("p", plain[0])
    write_lora_gguf(tmp_path / "a.gguf", peft, alpha=8.0, arch="llama")
    wrong = read_gguf_lora("g", tmp_path / "a.gguf", num_heads=KV_HEADS, num_kv_heads=HEADS)
    assert not torch.equal(wrong.weights[(0, "q_proj")][1], peft.weights[(0, "q_proj")][1])


def test_gguf_types_and_ranks(base_dir, plain, tmp_path):
    peft = read_peft_dir("p", plain[0])
    # F16 / BF16 both factors; Q8_0 A (rows of 64 / 128) with F16 B (rows of r=4 are too
    # short for Q8_0 blocks: the converter falls back to F16 there)
    for a_type, b_type, atol in (("F16", "F16", 2e-3), ("BF16", "BF16", 2e-2),
                                 ("Q8_0", "F16", 2e-2)):
        file = tmp_path / f"{a_type}.gguf"
        write_lora_gguf(file, peft, alpha=8.0, a_type=a_type, b_type=b_type)
        got = read_gguf_lora("g", file, num_heads=HEADS, num_kv_heads=KV_HEADS)
        assert_deltas(got, plain[1], atol=atol)
    # per-tensor ranks: llama.cpp scales each pair by alpha / its own rank, as PEFT does
    # with a rank_pattern (and no alpha_pattern)
    expected = make_peft(base_dir, tmp_path / "rp", rank_pattern={"q_proj": 2, "down_proj": 8})
    ranked = read_peft_dir("p", tmp_path / "rp")
    raw = LoRAAdapter(name="raw", path="", rank=8, scaling=1.0, weights={
        k: (a, b * (a.shape[0] / 8)) for k, (a, b) in ranked.weights.items()})  # unfold
    write_lora_gguf(tmp_path / "rp.gguf", raw, alpha=8.0)
    got = read_gguf_lora("g", tmp_path / "rp.gguf", num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert got.scaling == 1.0 and got.rank == 8
    assert_deltas(got, expected)
    # alpha 0: llama.cpp applies the pairs unscaled
    write_lora_gguf(tmp_path / "a0.gguf", peft, alpha=0.0)
    got = read_gguf_lora("g", tmp_path / "a0.gguf", num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert got.scaling == 1.0


def test_gguf_refusals(plain, tmp_path):
    peft = read_peft_dir("p", plain[0])
    one = LoRAAdapter(name="one", path="", rank=4, scaling=2.0,
                      weights={(0, "q_proj"): peft.weights[(0, "q_proj")]})
    cases = {
        "type": (dict(adapter_type="control_vector"), "not a llama.cpp LoRA adapter"),
        "embd": (dict(tensors={"token_embd.weight.lora_a": (np.zeros((4, 260), np.float32),
                                                            "F32")}), "token_embd"),
        "norm": (dict(tensors={"blk.0.attn_norm.weight": (np.ones(64, np.float32), "F32")}),
                 "attn_norm"),
        "a_only": (dict(tensors={"blk.1.ffn_up.weight.lora_a": (np.zeros((4, 64), np.float32),
                                                               "F32")}), "no lora_b"),
        "q4": (dict(a_type="Q4_0"), "Q4_0"),
    }
    for case, (extra, message) in cases.items():
        file = tmp_path / f"{case}.gguf"
        write_lora_gguf(file, one, alpha=8.0, **extra)
        with pytest.raises(ValueError, match=message):
            read_gguf_lora("g", file, num_heads=HEADS, num_kv_heads=KV_HEADS)
    with pytest.raises(ValueError, match="no such file"):
        read_gguf_lora("g", tmp_path / "absent.gguf", num_heads=HEADS, num_kv_heads=KV_HEADS)


def test_load_adapter_dispatch(plain, tmp_path):
    peft = load_adapter("p", plain[0], num_heads=HEADS, num_kv_heads=KV_HEADS)
    write_lora_gguf(tmp_path / "a.gguf", peft, alpha=8.0)
    got = load_adapter("g", str(tmp_path / "a.gguf"), num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert got.fingerprint == peft.fingerprint
    (tmp_path / "adapter.bin").write_bytes(b"x")
    for bad, message in ((tmp_path / "adapter.bin", "neither a directory nor a .gguf"),
                         (tmp_path / "missing", "does not exist")):
        with pytest.raises(ValueError, match=message) as e:
            load_adapter("x", bad, num_heads=HEADS, num_kv_heads=KV_HEADS)
        assert "PEFT adapter directory" in str(e.value)


def test_parse_lora_modules():
    specs = ["sql=/a/sql", '{"name": "chat", "path": "/b/chat.gguf", "base_model_name": "m"}',
             "", "eq=/c/x=y"]
    assert parse_lora_modules(specs) == (("sql", "/a/sql"), ("chat", "/b/chat.gguf"),
                                         ("eq", "/c/x=y"))
    assert parse_lora_modules([]) == ()
    for bad, message in ((["a=/x", "a=/y"], "given twice"),
                         (["/just/a/path"], "expected name=path"),
                         (["=/x"], "non-empty"), (["a="], "non-empty"),
                         (['{"name": "a"}'], "strings"), (['{"name": "a", "path": 1}'], "strings"),
                         (['{"name": "a", "path": "/x", "rank": 8}'], "unknown keys"),
                         (['{"name": "a",'], "not valid JSON"), (["[1]"], "expected")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
