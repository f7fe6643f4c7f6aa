"""llama.cpp's Gemma 3 mmproj GGUF read into kvserve's ImageEncoder (engine/vision/mmproj.py).

The files come from ``mmproj_writer``, a restatement of llama.cpp's converters, fed a tiny random
HF ``Gemma3ForConditionalGeneration`` (every weight random, the zero-initialised projector norm
included); the truth is HF's ``get_image_features``. What the converter stores in half precision
is rounded the same way in the HF model for the exact (1e-5) comparisons; the unrounded model is
the looser check. A key or tensor missing, a mismatch, another projector type: refused by name.
"""

from __future__ import annotations

import copy
import dataclasses

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3ForConditionalGeneration

from engine.vision.config import VisionConfig
from engine.vision.mmproj import gguf_names, load_mmproj_encoder, read_mmproj
from engine.vision.weights import find_layout
from tests.engine.vision.hf_vision_reference import tiny_hf_vision_model
from tests.engine.vision.mmproj_writer import (
    drop_key,
    set_key,
    stored_types,
    write_legacy_mmproj,
    write_mmproj,
)

ATOL = 1e-5
UINT32, STRING, BOOL = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING,
                        gguf.GGUFValueType.BOOL)


def _tiny(image_size: int, intermediate_size: int = 40) -> Gemma3ForConditionalGeneration:
    return tiny_hf_vision_model(image_size, intermediate_size)


@pytest.fixture(scope="module")
def hf_model():
    """8 patches a side pooled to 4: a scale factor of 2, which the converter writes down."""
    return _tiny(64)


@pytest.fixture(scope="module")
def hf_model_x4():
    """16 patches a side pooled to 4: Gemma 3's factor 4, which the converter leaves out."""
    return _tiny(128)


def _pixels(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def _features(model, pixels, half=lambda name, p: False) -> torch.Tensor:
    """HF's projected image features, with the parameters ``half`` picks rounded to float16
    first (as the mmproj stores them)."""
    if any(half(n, p) for n, p in model.named_parameters()):
        model = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if half(name, p):
                    p.copy_(p.half().float())
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels).pooler_output


def _projection(name, p) -> bool:
    return name.endswith("mm_input_projection_weight")


def _matrices(name, p) -> bool:
    """Every matrix but the embeddings: what --outtype f16 stores as F16."""
    in_tower = "vision_tower" in name and ".embeddings." not in name
    return (in_tower and p.dim() >= 2) or _projection(name, p)


def _raw(path, name) -> np.ndarray:
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def test_metadata_gives_the_hf_config_and_tensors_their_published_names(hf_model, tmp_path):
    path = write_mmproj(hf_model, tmp_path / "mmproj.gguf", outtype="f32")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 2
    config, tensors = read_mmproj(path)
    assert config == VisionConfig.from_hf(hf_model.config)
    assert config.tokens_per_image == 16 and config.pool_kernel == 2
    assert find_layout(tensors) == ("vision_tower.vision_model.", "multi_modal_projector.")
    assert set(tensors) == set(gguf_names(2).values())
    assert all(t.dtype == torch.float32 for t in tensors.values())
    # The file holds Gemma's gain 1 + w; the reader gives back HF's w.
    w = hf_model.model.multi_modal_projector.mm_soft_emb_norm.weight.detach()
    np.testing.assert_allclose(_raw(path, "mm.soft_emb_norm.weight"), w.numpy() + 1, atol=1e-6)
    torch.testing.assert_close(tensors["multi_modal_projector.mm_soft_emb_norm.weight"], w,
                               atol=1e-6, rtol=0)
    # The projection is stored as HF holds it, [hidden, text_hidden], not transposed.
    assert tensors["multi_modal_projector.mm_input_projection_weight"].shape == (32, 48)


def test_f32_mmproj_gives_hf_features(hf_model, tmp_path):
    """--outtype f32 still stores the projection in F16 (the converter forces it): exact
    against HF with that one matrix rounded, close against HF as it is."""
    path = write_mmproj(hf_model, tmp_path / "mmproj-f32.gguf", outtype="f32")
    types = stored_types(path)
    assert types.pop("mm.input_projection.weight") == "F16"
    assert set(types.values()) == {"F32"}
    pixels = _pixels(64)
    encoder = load_mmproj_encoder(path)
    assert next(encoder.parameters()).dtype == torch.float32
    got = encoder.encode(pixels)
    expected = _features(hf_model, pixels)
    assert got.shape == expected.shape == (2, 16, 48)
    assert expected.abs().max() > 1  # not a comparison between two zero tensors
    torch.testing.assert_close(got, _features(hf_model, pixels, _projection), atol=ATOL, rtol=0)
    torch.testing.assert_close(got, expected, atol=5e-3, rtol=0)
    torch.testing.assert_close(encoder.encode(pixels[1:]), got[1:], atol=ATOL, rtol=0)


def test_f16_mmproj_gives_hf_features(hf_model, tmp_path):
    path = write_mmproj(hf_model, tmp_path / "mmproj-f16.gguf", outtype="f16")
    types = stored_types(path)
    assert types["v.blk.0.attn_q.weight"] == types["v.blk.1.ffn_down.weight"] == "F16"
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"
    assert types["mm.soft_emb_norm.weight"] == types["v.blk.0.ln1.bias"] == "F32"
    pixels = _pixels(64)
    got = load_mmproj_encoder(path).encode(pixels)
    torch.testing.assert_close(got, _features(hf_model, pixels, _matrices), atol=ATOL, rtol=0)
    torch.testing.assert_close(got, _features(hf_model, pixels), atol=1e-2, rtol=0)


@pytest.mark.parametrize(("outtype", "atol"), [("bf16", 2e-2), ("q8_0", 6e-2)])
def test_bf16_and_q8_0_mmproj_are_dequantised(hf_model, tmp_path, outtype, atol):
    path = write_mmproj(hf_model, tmp_path / f"mmproj-{outtype}.gguf", outtype=outtype)
    types = stored_types(path)
    if outtype == "q8_0":  # fc2's rows (40 wide) do not fill Q8_0's 32-blocks: F16 instead
        assert types["v.blk.0.ffn_up.weight"] == "Q8_0"
        assert types["v.blk.0.ffn_down.weight"] == "F16"
    else:
        assert types["v.blk.0.ffn_up.weight"] == "BF16"
    pixels = _pixels(64)
    got = load_mmproj_encoder(path).encode(pixels)
    torch.testing.assert_close(got, _features(hf_model, pixels), atol=atol, rtol=0)


def test_gemma3s_own_scale_factor_is_left_out_and_means_4(hf_model_x4, tmp_path):
    path = write_mmproj(hf_model_x4, tmp_path / "mmproj.gguf", outtype="f32")
    assert "clip.vision.projector.scale_factor" not in gguf.GGUFReader(str(path)).fields
    config, _ = read_mmproj(path)
    assert config == VisionConfig.from_hf(hf_model_x4.config)
    assert config.pool_kernel == 4 and config.tokens_per_image == 16
    pixels = _pixels(128)
    torch.testing.assert_close(load_mmproj_encoder(path).encode(pixels),
                               _features(hf_model_x4, pixels, _projection), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("outtype", "atol"), [("f32", ATOL), ("q8_0", 3e-2)])
def test_legacy_script_files_with_swapped_mlp_names_load(hf_model_x4, tmp_path, outtype, atol):
    """The first Gemma 3 mmproj files named fc1 ffn_down and fc2 ffn_up (and stored the
    projection like any matrix); llama.cpp swaps them back by shape, and so does the reader."""
    path = write_legacy_mmproj(hf_model_x4, tmp_path / "mmproj-legacy.gguf", outtype=outtype)
    assert _raw(path, "v.blk.0.ffn_down.weight").shape == (40, 32)  # fc1's shape
    config, tensors = read_mmproj(path)
    assert config == VisionConfig.from_hf(hf_model_x4.config)
    fc1 = hf_model_x4.model.vision_tower.encoder.layers[0].mlp.fc1
    assert tensors["vision_tower.vision_model.encoder.layers.0.mlp.fc1.bias"].shape == (40,)
    if outtype == "f32":
        assert set(stored_types(path).values()) == {"F32"}
        torch.testing.assert_close(
            tensors["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"],
            fc1.weight.detach(), atol=0, rtol=0)
    pixels = _pixels(128)
    torch.testing.assert_close(load_mmproj_encoder(path).encode(pixels),
                               _features(hf_model_x4, pixels), atol=atol, rtol=0)


def test_the_mlp_names_decide_when_the_shapes_cannot(tmp_path):
    """With the MLP as wide as the tower, fc1 and fc2 have one shape: ffn_up is fc1 as named.
    (clip.cpp's legacy check, ffn_down's input width == hidden, would swap these too.)"""
    model = _tiny(64, intermediate_size=32)
    path = write_mmproj(model, tmp_path / "mmproj.gguf", outtype="f32")
    _, tensors = read_mmproj(path)
    fc1 = model.model.vision_tower.encoder.layers[1].mlp.fc1
    torch.testing.assert_close(tensors["vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight"],
                               fc1.weight.detach(), atol=0, rtol=0)
    pixels = _pixels(64)
    torch.testing.assert_close(load_mmproj_encoder(path).encode(pixels),
                               _features(model, pixels, _projection), atol=ATOL, rtol=0)


def test_mean_and_std_come_from_the_preprocessor_config(hf_model, tmp_path):
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    path = write_mmproj(hf_model, tmp_path / "mmproj.gguf", outtype="f32",
                        preprocessor={"image_mean": list(mean), "image_std": list(std),
                                      "image_seq_length": 16})
    config, _ = read_mmproj(path)
    # GGUF holds them as float32: CLIP's 8-digit constants come back to float32's precision.
    assert config.image_mean == pytest.approx(mean, rel=1e-7, abs=0)
    assert config.image_std == pytest.approx(std, rel=1e-7, abs=0)
    assert config.image_mean != (0.5, 0.5, 0.5)
    want = VisionConfig.from_hf(hf_model.config, image_mean=mean, image_std=std)
    assert dataclasses.replace(config, image_mean=mean, image_std=std) == want


def test_another_projector_type_is_refused(hf_model, tmp_path):
    path = write_mmproj(hf_model, tmp_path / "idefics3.gguf", outtype="f32",
                        edit=set_key("clip.projector_type", "idefics3", STRING))
    with pytest.raises(ValueError, match=r"projector type is 'idefics3'; only Gemma 3's"):
        read_mmproj(path)
    path = write_mmproj(hf_model, tmp_path / "none.gguf", outtype="f32",
                        edit=drop_key("clip.projector_type"))
    with pytest.raises(ValueError, match=r"clip.projector_type is missing: not a llama.cpp "
                                         r"mmproj file \(general.architecture is 'clip'\)"):
        read_mmproj(path)
    path = write_mmproj(hf_model, tmp_path / "no-vision.gguf", outtype="f32",
                        edit=set_key("clip.has_vision_encoder", False, BOOL))
    with pytest.raises(ValueError, match="clip.has_vision_encoder is not true"):
        read_mmproj(path)
    path = write_mmproj(hf_model, tmp_path / "gelu-quick.gguf", outtype="f32",
                        edit=drop_key("clip.use_gelu"))
    with pytest.raises(ValueError, match="clip.use_gelu is not true"):
        read_mmproj(path)


def test_a_missing_tensor_is_named(hf_model, tmp_path):
    for name in ("v.blk.1.attn_k.bias", "mm.soft_emb_norm.weight", "v.patch_embd.weight"):
        path = write_mmproj(hf_model, tmp_path / "mmproj.gguf", outtype="f32",
                            drop_tensors=[name])
        with pytest.raises(ValueError, match=rf"tensor {name} is missing"):
            read_mmproj(path)


@pytest.mark.parametrize("key", [
    "clip.has_vision_encoder", "clip.vision.image_size", "clip.vision.patch_size",
    "clip.vision.embedding_length", "clip.vision.feed_forward_length",
    "clip.vision.block_count", "clip.vision.attention.head_count",
    "clip.vision.attention.layer_norm_epsilon", "clip.vision.projection_dim",
    "clip.vision.image_mean", "clip.vision.image_std"])
def test_a_missing_key_is_named(hf_model, tmp_path, key):
    path = write_mmproj(hf_model, tmp_path / "mmproj.gguf", outtype="f32", edit=drop_key(key))
    with pytest.raises(ValueError, match=rf"key {key} is missing"):
        read_mmproj(path)


def test_metadata_at_odds_with_the_tensors_is_refused(hf_model, tmp_path):
    def refused(edit, match):
        path = write_mmproj(hf_model, tmp_path / "mmproj.gguf", outtype="f32", edit=edit)
        with pytest.raises(ValueError, match=match):
            load_mmproj_encoder(path)

    refused(set_key("clip.vision.block_count", 1, UINT32),
            r"unexpected tensors for a Gemma 3 mmproj with 1 blocks: \['v.blk.1.")
    refused(set_key("clip.vision.projection_dim", 64, UINT32),
            "projection_dim is 64 but mm.input_projection.weight projects to 48")
    refused(set_key("clip.vision.embedding_length", 48, UINT32),
            r"mm.input_projection.weight has shape \[32, 48\], expected \[48, text width\]")
    refused(set_key("clip.vision.feed_forward_length", 64, UINT32),
            r"encoder.layers.0.mlp.fc1.weight has shape \[40, 32\], expected \[64, 32\]")
    refused(set_key("clip.vision.projector.scale_factor", 3, UINT32),
            "scale_factor 3 does not divide the 8 patches per side")
    refused(set_key("clip.vision.image_size", 60, UINT32),
            "image_size 60 is not a multiple of clip.vision.patch_size 8")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "mmproj.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read .* as GGUF"):
        read_mmproj(path)
