"""Streaming eviction on the embedded model (slow): SmolLM2-135M decoding a fixed 1,024-token
text, every token forced (``kvserve bench streaming``, loadgen/streaming.py, which prints
docs/performance.md's table for 1,536), with ``--kv-eviction sink:4,window:256`` at
``max_model_len`` 512, i.e. 2x past its context.

What must hold: the log-probs equal eviction off's until the first eviction (the same
computation); the sequence never holds more than 1 + 16 + 1 blocks; the perplexity of the
tokens past the context stays within 25% of eviction off's (which sees the whole text); and
the same window WITHOUT sinks does worse (StreamingLLM's finding)."""

from __future__ import annotations

import pytest

from loadgen.streaming import format_table, measure

pytestmark = pytest.mark.slow


def test_sinks_keep_perplexity_past_the_context():
    # 1,024 forced tokens (2x past the context; docs/performance.md's table has 1,536): a third of the
    # decode steps, the same evictions and comparisons.
    rows = measure(tokens=1024, max_model_len=512, sink=4, window=256)
    print("\n" + format_table(rows, 1024, 512, 512))
    off, sink, window_only = rows
    assert sink.peak_blocks <= 18 and sink.evicted_blocks > 0
    assert off.peak_blocks > 18 and off.evicted_blocks == 0
    assert sink.max_diff_before_eviction < 1e-3
    assert sink.ppl_past_context <= 1.25 * off.ppl_past_context
    assert window_only.ppl_past_context > sink.ppl_past_context
