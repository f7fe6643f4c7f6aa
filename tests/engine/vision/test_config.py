"""VisionConfig: read from a HF Gemma3Config and from its config.json dict alike, and refused
with a message naming the fault when its values cannot describe a Gemma 3 image side."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import Gemma3Config

from engine.vision.config import VisionConfig

GOOD = dict(image_size=64, patch_size=8, hidden_size=32, intermediate_size=40, num_layers=2,
            num_heads=2, mm_tokens_per_image=16, text_hidden_size=48)


def _hf_config() -> Gemma3Config:
    return Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=24),
        vision_config=dict(image_size=64, patch_size=8, hidden_size=32, intermediate_size=40,
                           num_hidden_layers=2, num_attention_heads=2, layer_norm_eps=1e-5),
        mm_tokens_per_image=16)


def test_from_hf_config_object_and_dict_agree():
    hf = _hf_config()
    cfg = VisionConfig.from_hf(hf)
    assert cfg == VisionConfig.from_hf(hf.to_dict())
    assert cfg == VisionConfig(**GOOD, layer_norm_eps=1e-5)
    assert (cfg.patches_per_side, cfg.num_patches, cfg.tokens_per_side, cfg.pool_kernel) == (8, 64, 4, 2)
    assert cfg.tokens_per_image == 16 and cfg.head_dim == 16
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.image_std == (0.5, 0.5, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.image_size = 32


def test_from_hf_reads_a_published_style_config_json():
    """Gemma 3's config.json leaves SigLIP's constants out; they take SigLIP's defaults."""
    data = {"mm_tokens_per_image": 256, "text_config": {"hidden_size": 2560},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                              "model_type": "siglip_vision_model", "num_attention_heads": 16,
                              "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    cfg = VisionConfig.from_hf(data, image_mean=(0.1, 0.2, 0.3), image_std=(1, 2, 3))
    assert (cfg.patches_per_side, cfg.tokens_per_side, cfg.pool_kernel) == (64, 16, 4)
    assert cfg.layer_norm_eps == 1e-6 and cfg.image_std == (1.0, 2.0, 3.0)
    del data["vision_config"]["patch_size"]
    with pytest.raises(ValueError, match="vision_config.patch_size is missing"):
        VisionConfig.from_hf(data)
    with pytest.raises(ValueError, match="vision_config is missing"):
        VisionConfig.from_hf({"text_config": {"hidden_size": 8}, "mm_tokens_per_image": 4})
    good = _hf_config().to_dict()
    good["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        VisionConfig.from_hf(good)


@pytest.mark.parametrize("change, message", [
    (dict(mm_tokens_per_image=15), "not a square number"),
    (dict(mm_tokens_per_image=9), "8 patches per side cannot be pooled evenly to 3"),
    (dict(image_size=60), "not a multiple of patch_size"),
    (dict(num_heads=3), "not divisible by num_heads"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(num_layers=True), "num_layers must be a positive int"),
    (dict(image_size=64.0), "image_size must be a positive int"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    (dict(image_mean=(0.5, 0.5)), "image_mean must be 3 numbers"),
    (dict(image_std=(0.5, 0.0, 0.5)), "image_std must be positive"),
    (dict(num_channels=4), "num_channels must be 3"),
])
def test_inconsistent_values_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig(**{**GOOD, **change})
