"""Our model code vs HF transformers' forward pass on the same random weights.

One prompt is run as a full prefill, then as a prefill of all but the last 3 tokens followed by
3 single-token decodes through the paged cache (shuffled block table). Logits must match HF's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loading.tiny import tiny_config
from engine.models.registry import build_model

BS = 4


def _meta(start: int, n: int, table: list[int]) -> AttentionMetadata:
    positions = torch.arange(start, start + n)
    bt = torch.tensor([table], dtype=torch.int32)
    slots = bt[0, positions // BS].long() * BS + positions % BS
    return AttentionMetadata(
        slot_mapping=slots, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32), block_tables=bt, block_size=BS,
        max_query_len=n, max_seq_len=start + n, num_decodes=int(n == 1),
        num_decode_tokens=int(n == 1), query_lens_cpu=[n], seq_lens_cpu=[start + n])


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("mistral", {"sliding_window": 5}),
    ("qwen2", {}),
    ("qwen3", {}),
])
def test_logits_match_hf(model_type, overrides):
    torch.manual_seed(0)
    config = tiny_config(model_type, **overrides)
    hf = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    ours = build_model(hf.config)
    ours.load_weights(hf.state_dict().items())
    ours.eval()
    a = ours.arch
    ids = torch.randint(0, config.vocab_size, (13,))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
    num_blocks = 8
    table = [5, 2, 7, 0]  # shuffled, non-contiguous
    backend = TorchAttentionBackend()

    def pools():
        shape = (num_blocks, BS, a.num_kv_heads, a.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(a.num_layers)]

    with torch.inference_mode():
        kv = pools()
        h = ours(ids, torch.arange(13), kv, _meta(0, 13, table), backend)
        torch.testing.assert_close(ours.compute_logits(h), ref, rtol=1e-4, atol=1e-4)

        kv = pools()
        h = ours(ids[:10], torch.arange(10), kv, _meta(0, 10, table), backend)
        got = [ours.compute_logits(h)[-1]]
        for pos in range(10, 13):
            h = ours(ids[pos:pos + 1], torch.tensor([pos]), kv, _meta(pos, 1, table), backend)
            got.append(ours.compute_logits(h)[0])
        torch.testing.assert_close(torch.stack(got), ref[9:], rtol=1e-4, atol=1e-4)
