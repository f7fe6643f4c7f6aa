"""HF transformers greedy decoding: the independent truth for engine outputs (tests, and the
parity check of ``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def load_hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              device: str | torch.device | None = None) -> list[int]:
    """Greedy continuation of one prompt through HF's own forward pass and KV cache, EOS
    ignored (not suppressed): exactly ``max_new_tokens`` tokens, as ``ignore_eos=True`` gives.

    (``generate`` is not used because it stops at the model's EOS even when told not to, and
    ``min_new_tokens`` would suppress EOS instead of ignoring it.) ``device``: where the
    model's weights are (None: the CPU).
    """
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens
