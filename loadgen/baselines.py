"""Baselines run next to kvserve in ``bench offline``: HF transformers and KV-cache-off.

* HF transformers: ``model.generate`` on a static batch (all prompts of a batch start and end
  together; shorter prompts left-padded), greedy, exactly ``output_len`` new tokens
  (``min_new_tokens = max_new_tokens``), on the same weights and dtype as the engine.
* KV cache off: kvserve's own engine with prefix caching disabled, asked for ONE token at a time
  on the whole sequence so far (``LLM.generate(seq, max_tokens=1)`` per step, all sequences in
  one call). Every step therefore recomputes every token's keys and values, which is what
  generation without a KV cache costs; the model, kernels and batching are kvserve's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.kv_calc import ModelShape


@dataclass
class BaselineResult:
    name: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    token_ids: list[list[int]]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-9)


def load_hf_model(model_path: str, dtype):
    """The transformers model of an HF directory (the engine's converted one for GGUFs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
    model.eval()
    return model


def hf_static_generate(model, prompts: Sequence[Sequence[int]], output_len: int,
                       batch_size: int | None = None, pad_id: int = 0) -> BaselineResult:
    """Greedy static-batch generation of exactly ``output_len`` tokens per prompt."""
    import torch

    batch_size = batch_size or len(prompts)
    outs: list[list[int]] = []
    # Warm-up outside the timing: the first call pays one-off allocations and lazy inits.
    with torch.inference_mode():
        model.generate(torch.tensor([list(prompts[0][:8])]), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=pad_id)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[i:i + batch_size]]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=pad_id)
            outs.extend(gen[:, width:].tolist())
    wall = time.perf_counter() - start
    return BaselineResult("HF transformers generate (static batch "
                          f"{batch_size})", wall, sum(len(p) for p in prompts),
                          sum(len(o) for o in outs), outs)


def recompute_generate(llm, prompts: Sequence[Sequence[int]], output_len: int) -> BaselineResult:
    """Generation without a KV cache, through kvserve's engine (see the module docstring).

    ``llm`` must have prefix caching off, or later steps would reuse earlier steps' keys.
    """
    from engine import SamplingParams

    if llm.config.enable_prefix_caching:
        raise ValueError("the recompute baseline needs an LLM with enable_prefix_caching=False")
    seqs = [list(p) for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for _ in range(output_len):
        for seq, out in zip(seqs, llm.generate(seqs, params), strict=True):
            seq.append(out.outputs[0].token_ids[0])
    wall = time.perf_counter() - start
    return BaselineResult("kvserve, KV cache off (recompute every step)", wall,
                          sum(len(p) for p in prompts), len(prompts) * output_len,
                          [s[len(p):] for s, p in zip(seqs, prompts, strict=True)])


def recompute_flops(shape: ModelShape, prompt_lens: Sequence[int], output_len: int) -> float:
    """Dense FLOPs of the KV-cache-off run: step g processes every sequence's P + g tokens."""
    tokens = sum(p * output_len + output_len * (output_len - 1) // 2 for p in prompt_lens)
    return 2.0 * shape.non_embedding_params() * tokens


def match_fraction(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Mean share of each sequence that two greedy runs agree on before they first differ.

    A sanity check, not a test: identical weights give identical greedy tokens until a
    near-tie between two logits flips under different batching or kernels.
    """
    if not a:
        return float("nan")
    total = 0.0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        same = next((i for i in range(n) if x[i] != y[i]), n)
        total += same / max(n, 1)
    return total / len(a)
