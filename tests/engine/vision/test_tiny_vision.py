"""The tiny random Gemma 3 vision checkpoint loads like a real HF directory (config, model,
tokenizer with single-id specials, Gemma 3 chat template), and HF's reference over it sees
the images: its bidirectional image mask is on, and different images give different logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

from engine.loading.tiny_vision import (
    BOI,
    EOI,
    IMAGE_TOKEN,
    SPECIAL_IDS,
    VOCAB,
    make_tiny_gemma3_vision_dir,
)
from tests.engine.vision.hf_vision_reference import (
    expand_images,
    hf_forward,
    hf_greedy,
    load_hf_vision,
    pixels_for,
    token_type_ids_for,
)

TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_gemma3_vision_dir(tmp_path_factory.mktemp("tiny-gemma3-vision"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_hf_vision(model_dir)


def _noise(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (80, 100, 3), dtype=np.uint8), mode="RGB")


RED = Image.new("RGB", (64, 64), (255, 0, 0))
BLUE = Image.new("RGB", (48, 70), (0, 0, 255))


def _prompt(tokenizer, content) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(expand_images(text, TOKENS_PER_IMAGE), add_special_tokens=False).input_ids


ONE_IMAGE = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
TWO_IMAGES = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
              {"type": "image"}]


def test_config_loads_as_gemma3(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    assert isinstance(config, Gemma3Config) and config.model_type == "gemma3"
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert config.image_token_id == SPECIAL_IDS[IMAGE_TOKEN]
    assert config.boi_token_index == SPECIAL_IDS[BOI]
    assert config.eoi_token_index == SPECIAL_IDS[EOI]
    assert config.mm_tokens_per_image == TOKENS_PER_IMAGE
    text = config.text_config
    assert text.model_type == "gemma3_text" and text.vocab_size == VOCAB
    assert max(SPECIAL_IDS.values()) < VOCAB
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (64, 4, 32)
    assert (text.num_key_value_heads, text.sliding_window, text.query_pre_attn_scalar) == (1, 8, 24)
    assert text.layer_types == ["sliding_attention", "full_attention"] * 2
    vision = config.vision_config
    assert (vision.image_size, vision.patch_size, vision.hidden_size) == (64, 8, 32)
    assert (vision.num_hidden_layers, vision.vision_use_head) == (2, False)


def test_model_loads_every_weight_and_all_are_random(model_dir):
    model, info = Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    for name, p in model.named_parameters():  # HF's zero-initialised ones included
        assert p.std() > 0.05, name
    assert model.model.language_model.embed_tokens.weight.shape == (VOCAB, 64)


def test_tokenizer_specials_are_single_ids(tokenizer):
    for token, id_ in SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == id_
        assert tokenizer(token, add_special_tokens=False).input_ids == [id_]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)
    assert len(tokenizer) <= VOCAB
    text = f"ab{BOI}{IMAGE_TOKEN * 3}{EOI}<end_of_turn>x"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[2:7] == [SPECIAL_IDS[BOI]] + [SPECIAL_IDS[IMAGE_TOKEN]] * 3 + [SPECIAL_IDS[EOI]]
    assert ids[7] == SPECIAL_IDS["<end_of_turn>"] and len(ids) == 9
    assert tokenizer.decode(ids) == text


def test_chat_template_is_gemma3s(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                             {"type": "text", "text": "what?"}]},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "Sure?"}]
    got = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == ("<s><start_of_turn>user\nBe brief.\n\nLook:<start_of_image>what?<end_of_turn>\n"
                   "<start_of_turn>model\nA cat.<end_of_turn>\n"
                   "<start_of_turn>user\nSure?<end_of_turn>\n<start_of_turn>model\n")
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<s><start_of_turn>user\nhi<end_of_turn>\n"


def test_expand_images_mirrors_hf_processor():
    text = f"a{BOI}b{BOI}"
    block = f"\n\n{BOI}{IMAGE_TOKEN * 4}{EOI}\n\n"
    assert expand_images(text, 4) == f"a{block}b{block}"


def test_pixels_for_gives_the_tiny_image_size():
    pixels = pixels_for([_noise(1), RED, BLUE])
    assert pixels.shape == (3, 3, 64, 64) and pixels.dtype == torch.float32
    assert torch.all(pixels[1, 0] == 1.0) and torch.all(pixels[1, 2] == -1.0)  # red


def test_one_image_greedy(tokenizer, model):
    ids = _prompt(tokenizer, ONE_IMAGE)
    assert ids.count(SPECIAL_IDS[IMAGE_TOKEN]) == TOKENS_PER_IMAGE
    out = hf_greedy(model, ids, pixels_for([RED]), 6)
    assert len(out) == 6 and all(0 <= t < VOCAB for t in out)
    # The manual loop is HF's own generate (with the image mask), up to an EOS it stops at.
    gen = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels_for([RED]),
                         token_type_ids=token_type_ids_for(model, ids),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert gen == out[:len(gen)] and len(gen) >= 1


def test_two_images_greedy(tokenizer, model):
    ids = _prompt(tokenizer, TWO_IMAGES)
    assert ids.count(SPECIAL_IDS[IMAGE_TOKEN]) == 2 * TOKENS_PER_IMAGE
    out = hf_greedy(model, ids, pixels_for([RED, _noise(2)]), 6)
    assert len(out) == 6 and all(0 <= t < VOCAB for t in out)
    # Each image fills its own run of soft tokens: swapping them changes the logits.
    ab = hf_forward(model, ids, pixels_for([RED, _noise(2)]))
    ba = hf_forward(model, ids, pixels_for([_noise(2), RED]))
    assert (ab[-1] - ba[-1]).abs().max() > 1e-2


def test_different_images_give_different_logits(tokenizer, model):
    ids = _prompt(tokenizer, ONE_IMAGE)
    logits = [hf_forward(model, ids, pixels_for([im]))[-1] for im in (RED, BLUE, _noise(1))]
    for i in range(3):
        for j in range(i):
            assert (logits[i] - logits[j]).abs().max() > 1e-2
    # The image changes the greedy tokens too, for these two.
    assert hf_greedy(model, ids, pixels_for([RED]), 3) != hf_greedy(model, ids, pixels_for([BLUE]), 3)


def test_the_image_mask_is_bidirectional(tokenizer, model):
    """With token_type_ids an image's soft tokens see each other both ways: the logits differ
    from those of a causal mask, already at the image's first soft token."""
    ids = _prompt(tokenizer, ONE_IMAGE)
    pixels = pixels_for([_noise(1)])
    with_mask = hf_forward(model, ids, pixels)
    causal = hf_forward(model, ids, pixels, image_mask=False)
    first = ids.index(SPECIAL_IDS[IMAGE_TOKEN])
    torch.testing.assert_close(with_mask[:first], causal[:first], atol=1e-5, rtol=0)
    assert (with_mask[first] - causal[first]).abs().max() > 1e-2
    assert (with_mask[-1] - causal[-1]).abs().max() > 1e-2


def test_fewer_tokens_per_image(tmp_path, tokenizer):
    path = make_tiny_gemma3_vision_dir(tmp_path / "m4", seed=1, mm_tokens_per_image=4)
    assert AutoConfig.from_pretrained(path).mm_tokens_per_image == 4
    text = tokenizer.apply_chat_template([{"role": "user", "content": ONE_IMAGE}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(expand_images(text, 4), add_special_tokens=False).input_ids
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert len(hf_greedy(model, ids, pixels_for([RED]), 3)) == 3
