"""Shared by the stored-tier engine tests (test_kv_remote_engine.py, test_tp_kv_tiers.py):
greedy runs that check the KV manager's integrity, and the longest hit a prompt can have."""

from __future__ import annotations

from engine import LLM, SamplingParams

BS = 4  # the tests' block size
NEW = 6  # tokens generated per prompt


def run_greedy(llm: LLM, prompts):
    """``(token ids, cached tokens)`` per prompt; every output runs to ``NEW`` tokens."""
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompts, [sp] * len(prompts))
    llm.engine.kv.check_integrity()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def full_prefix(prompt) -> int:
    """The longest hit a prompt can have: its full blocks, never its last token."""
    return (len(prompt) - 1) // BS * BS
