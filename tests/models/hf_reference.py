"""HF transformers greedy generation: the independent truth for engine outputs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def load_hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt, EOS ignored (exactly max_new_tokens tokens)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
