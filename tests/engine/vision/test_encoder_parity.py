"""kvserve's ImageEncoder gives HF's Gemma3ForConditionalGeneration.get_image_features, for a
tiny random model whose every weight (the zero-initialised projector and norms included) is
random: loaded from the state dict, from save_pretrained's safetensors, and from each of the
name layouts checkpoints have used; a missing, misshapen or surplus tensor is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma3Config

from engine.vision.config import VisionConfig
from engine.vision.encoder import ImageEncoder
from engine.vision.weights import LAYOUTS, find_layout, load_image_encoder
from tests.engine.vision.hf_vision_reference import tiny_hf_vision_model

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_vision_model()


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(hf_model, pixels):
    with torch.no_grad():
        out = hf_model.get_image_features(pixel_values=pixels)
    features = out.pooler_output  # transformers 5: the projected features, [B, tokens, text]
    assert features.shape == (2, 16, 48)
    return features


def _vision_state(model) -> dict[str, torch.Tensor]:
    """The tower and projector tensors, under transformers 5's in-memory names."""
    return {k: v.clone() for k, v in model.state_dict().items()
            if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}


def _rename(state: dict[str, torch.Tensor], tower: str, projector: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("model.vision_tower."):
            out[tower + k.removeprefix("model.vision_tower.")] = v
        else:
            out[projector + k.removeprefix("model.multi_modal_projector.")] = v
    return out


def test_state_dict_gives_hf_features(hf_model, pixels, expected):
    cfg = VisionConfig.from_hf(hf_model.config)
    encoder = load_image_encoder(cfg, hf_model.state_dict())
    got = encoder.encode(pixels)
    assert got.dtype == torch.float32 and got.shape == (2, cfg.tokens_per_image, 48)
    assert expected.abs().max() > 0.1  # the comparison is not between two zero tensors
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # Each image on its own gives its row of the batch.
    torch.testing.assert_close(encoder.encode(pixels[1:]), expected[1:], atol=ATOL, rtol=0)


def test_tower_alone_gives_hf_last_hidden_state(hf_model, pixels):
    cfg = VisionConfig.from_hf(hf_model.config)
    encoder = load_image_encoder(cfg, hf_model.state_dict())
    with torch.no_grad():
        want = hf_model.model.vision_tower(pixel_values=pixels).last_hidden_state
        got = encoder.tower(pixels)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: t[0].rstrip("."))
def test_every_name_layout_loads(hf_model, pixels, expected, layout):
    state = _rename(_vision_state(hf_model), *layout)
    assert find_layout(state) == layout
    encoder = load_image_encoder(VisionConfig.from_hf(hf_model.config), state)
    torch.testing.assert_close(encoder.encode(pixels), expected, atol=ATOL, rtol=0)


def test_save_pretrained_directory_loads(hf_model, pixels, expected, tmp_path):
    hf_model.save_pretrained(tmp_path)
    cfg = VisionConfig.from_hf(Gemma3Config.from_pretrained(tmp_path))
    encoder = load_image_encoder(cfg, tmp_path)
    torch.testing.assert_close(encoder.encode(pixels), expected, atol=ATOL, rtol=0)


def test_sharded_bf16_files_in_the_published_layout_load(hf_model, pixels, expected, tmp_path):
    """Gemma 3's published files: vision_tower.vision_model.* in bfloat16, over two shards;
    the encoder stays float32 and matches HF run on the same bf16-rounded weights."""
    state = _rename(_vision_state(hf_model), "vision_tower.vision_model.", "multi_modal_projector.")
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[1::2]} | {"language_model.x": torch.zeros(3)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    encoder = load_image_encoder(VisionConfig.from_hf(hf_model.config), tmp_path)
    assert next(encoder.parameters()).dtype == torch.float32
    got = encoder.encode(pixels)
    assert not torch.allclose(got, expected, atol=ATOL)  # the rounding is visible...
    rounded = load_image_encoder(
        VisionConfig.from_hf(hf_model.config),
        {k: v.to(torch.bfloat16).float() for k, v in _vision_state(hf_model).items()})
    torch.testing.assert_close(got, rounded.encode(pixels), atol=0, rtol=0)  # ...and exact


def test_missing_misshapen_and_surplus_tensors_are_named(hf_model):
    cfg = VisionConfig.from_hf(hf_model.config)
    state = _vision_state(hf_model)
    name = "model.vision_tower.encoder.layers.1.mlp.fc2.bias"
    with pytest.raises(ValueError, match=f"{name} is missing"):
        load_image_encoder(cfg, {k: v for k, v in state.items() if k != name})
    name = "model.multi_modal_projector.mm_input_projection_weight"
    with pytest.raises(ValueError, match=rf"{name} has shape \[48, 32\], expected \[32, 48\]"):
        load_image_encoder(cfg, {**state, name: state[name].t()})
    extra = "model.vision_tower.encoder.layers.2.mlp.fc2.bias"
    with pytest.raises(ValueError, match=f"unexpected vision tensors.*{extra}"):
        load_image_encoder(cfg, {**state, extra: torch.zeros(32)})
    with pytest.raises(ValueError, match="no Gemma 3 vision tower"):
        load_image_encoder(cfg, {"model.language_model.embed_tokens.weight": torch.zeros(3)})
    # SigLIP's unused pooling head is not a surplus tensor.
    load_image_encoder(cfg, {**state, "model.vision_tower.head.probe": torch.zeros(1, 1, 32)})


def test_encode_checks_the_pixel_shape(hf_model):
    encoder = ImageEncoder(VisionConfig.from_hf(hf_model.config))
    for bad in (torch.zeros(3, 64, 64), torch.zeros(1, 3, 32, 32), torch.zeros(0, 3, 64, 64)):
        with pytest.raises(ValueError, match=r"pixel_values must be \[B, 3, 64, 64\]"):
            encoder.encode(bad)
