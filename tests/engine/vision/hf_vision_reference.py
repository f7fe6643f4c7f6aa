"""HF transformers as the independent truth for Gemma 3 with images: the prompt expansion of
HF's ``Gemma3Processor``, the pixel values of HF's own image processor, and the greedy
continuation of ``Gemma3ForConditionalGeneration`` (with its bidirectional image mask).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from pathlib import Path

import torch
from PIL import Image
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


def tiny_hf_vision_model(image_size: int = 64, intermediate_size: int = 40
                         ) -> Gemma3ForConditionalGeneration:
    """A tiny random Gemma 3 (one text layer, a 2-layer tower over ``image_size`` pixels in
    8x8 patches, 16 soft tokens), every weight drawn: HF zero-initialises the projector and
    the (1 + w) norms, which would hide a missed one."""
    config = Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=24, sliding_window=16),
        vision_config=dict(image_size=image_size, patch_size=8, hidden_size=32,
                           intermediate_size=intermediate_size, num_hidden_layers=2,
                           num_attention_heads=2, vision_use_head=False),
        mm_tokens_per_image=16)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def expand_images(text: str, tokens_per_image: int) -> str:
    """What ``Gemma3Processor`` does to the text: each ``<start_of_image>`` becomes
    ``"\\n\\n<start_of_image>" + "<image_soft_token>" * n + "<end_of_image>\\n\\n"``."""
    return text.replace(BOI, f"\n\n{BOI}{IMAGE_TOKEN * tokens_per_image}{EOI}\n\n")


def pixels_for(images: list[Image.Image], image_size: int = 64) -> torch.Tensor:
    """HF's Gemma 3 image processor (its PIL backend) at ``image_size``: [N, 3, size, size]."""
    processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    return processor(images=images, return_tensors="pt")["pixel_values"]


@lru_cache(maxsize=4)
def load_hf_vision(path: str | Path) -> Gemma3ForConditionalGeneration:
    """The checkpoint in float32 with eager attention (cached: treat it as read-only)."""
    return Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def token_type_ids_for(model, input_ids: list[int]) -> torch.Tensor:
    """1 at the image soft tokens, 0 elsewhere: what HF's processor returns, and what turns on
    the bidirectional attention within each image."""
    ids = torch.tensor([input_ids])
    return (ids == model.config.image_token_id).long()


def _model(path_or_model) -> Gemma3ForConditionalGeneration:
    if isinstance(path_or_model, torch.nn.Module):
        return path_or_model
    return load_hf_vision(path_or_model)


def _cache_kwargs(model, out) -> dict:
    """The KV cache of ``out`` for the next step: transformers 5 renamed ``past_key_values``
    to ``cache`` (the old name is deprecated)."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def hf_forward(path, input_ids: list[int], pixel_values: torch.Tensor | None,
               image_mask: bool = True) -> torch.Tensor:
    """One forward over the whole prompt: logits [len(input_ids), vocab]. ``path``: the
    checkpoint, or its loaded model. ``image_mask=False`` leaves out ``token_type_ids`` (a
    causal mask over the images too: not what Gemma 3 does, only a contrast for tests)."""
    model = _model(path)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([input_ids]), pixel_values=pixel_values,
                    token_type_ids=token_type_ids_for(model, input_ids) if image_mask else None,
                    use_cache=False)
    return out.logits[0]


def hf_greedy(path, input_ids: list[int], pixel_values: torch.Tensor | None,
              max_new_tokens: int) -> list[int]:
    """Greedy continuation through HF's forward and KV cache, EOS ignored: exactly
    ``max_new_tokens`` tokens, as ``ignore_eos=True`` gives (see engine/loading/hf_reference.py).
    ``path``: the checkpoint, or its loaded model.

    ``input_ids`` already holds the expanded image tokens (``expand_images``), one run of
    ``mm_tokens_per_image`` soft tokens per row of ``pixel_values``. The prefill gets
    ``token_type_ids`` (the bidirectional image mask), the decode steps none: as HF's
    ``generate`` does.
    """
    model = _model(path)
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([input_ids]), pixel_values=pixel_values,
                    token_type_ids=token_type_ids_for(model, input_ids), use_cache=True)
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]]), use_cache=True,
                        **_cache_kwargs(model, out))
    return tokens
