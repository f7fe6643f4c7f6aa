"""A tiny randomly initialised Gemma 3 vision-language checkpoint for tests (no download).

``make_tiny_gemma3_vision_dir`` writes a ``Gemma3ForConditionalGeneration`` directory (config,
safetensors, tokenizer) that loads exactly like a real HF one: the text side is ``tiny.py``'s
tiny Gemma 3 text model (hidden 64, 4 layers alternating sliding window 8 / full, head_dim 32,
1 KV head), the image side a 2-layer SigLIP tower over 64x64 pixels in 8x8 patches, pooled to
``mm_tokens_per_image`` soft tokens. Every weight is random: HF zero-initialises the projector
and the (1 + w) RMSNorms, which would hide a missed one.

The tokenizer is ``tiny.py``'s byte-level one (256 byte tokens, ``<s>`` = 256, ``</s>`` = 257)
plus Gemma 3's turn and image specials, each one id that is never split (``SPECIAL_IDS``), with
a Gemma-3-style chat template that renders an ``{"type": "image"}`` part as ``<start_of_image>``
(HF's processor, and so the server, then expands it: see ``expand_images`` in the tests).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PreTrainedTokenizerFast

from engine.loading.tiny import byte_tokenizer, tiny_config

BOS, EOS = "<s>", "</s>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Their ids: bytes take 0..255, then <s>, </s>, then the specials in this order.
SPECIAL_IDS = {BOS: 256, EOS: 257, START_OF_TURN: 258, END_OF_TURN: 259, BOI: 260, EOI: 261,
               IMAGE_TOKEN: 262}
VOCAB = 264  # covers every id above, plus a spare

# Gemma 3's own template (google/gemma-3-*-it), with <s> as its BOS: a system message is folded
# into the first user turn, content is a string or a list of {"type": "text" | "image"} parts.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def tiny_gemma3_vision_tokenizer() -> PreTrainedTokenizerFast:
    """The byte tokenizer plus Gemma 3's specials (ids in ``SPECIAL_IDS``)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [START_OF_TURN, END_OF_TURN, BOI, EOI,
                                                          IMAGE_TOKEN]})
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    got = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_IDS}
    if got != SPECIAL_IDS:  # the ids are part of the checkpoint's contract
        raise RuntimeError(f"tiny Gemma 3 vision tokenizer ids moved: {got}")
    return tok


def tiny_gemma3_vision_config(mm_tokens_per_image: int = 16) -> Gemma3Config:
    text = tiny_config("gemma3_text", vocab_size=VOCAB).to_dict()
    return Gemma3Config(
        text_config=text,
        vision_config=dict(image_size=64, patch_size=8, hidden_size=32, intermediate_size=40,
                           num_hidden_layers=2, num_attention_heads=2, vision_use_head=False),
        mm_tokens_per_image=mm_tokens_per_image,
        image_token_index=SPECIAL_IDS[IMAGE_TOKEN], boi_token_index=SPECIAL_IDS[BOI],
        eoi_token_index=SPECIAL_IDS[EOI],
        bos_token_id=SPECIAL_IDS[BOS], eos_token_id=SPECIAL_IDS[EOS],
        pad_token_id=SPECIAL_IDS[EOS], tie_word_embeddings=True)


def make_tiny_gemma3_vision_dir(path: Path, seed: int = 0, mm_tokens_per_image: int = 16) -> Path:
    """Write a tiny random ``Gemma3ForConditionalGeneration`` checkpoint into ``path``."""
    path = Path(path)
    config = tiny_gemma3_vision_config(mm_tokens_per_image)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    text_std = config.text_config.initializer_range  # tiny.py's text weights: normal(0, this)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".language_model." not in f".{name}":  # the tower and the projector: all of it
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):  # Gemma norms scale by (1 + w), w = 0 at init
                p.normal_(0.0, 0.3)
            elif name.endswith("embed_tokens.weight"):  # x sqrt(hidden): keep it small
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, text_std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tiny_gemma3_vision_tokenizer().save_pretrained(path)
    return path
