"""Speculative decoding: propose k tokens per decoding sequence, verify them in one step.

* ``config``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` JSON object);
* ``proposer``: the ``Proposer`` protocol the scheduler calls once per step;
* ``ngram``: the prompt-lookup proposer;
* ``draft_model``: a small model's greedy drafts, with its own paged KV (``factory`` loads it);
* ``verifier``: exact verification (greedy prefix match; point-mass rejection sampling);
* ``stats``: the ``spec_decode_*`` counters.

Flow of one step: the scheduler asks the proposer for drafts of its decoding sequences (unless
the adaptive switch is off for this batch size), gives each speculating sequence
``1 + len(draft)`` query positions (budgeted like any token), and the plan marks all of them
sampled; the core verifies the rows, appends the kept tokens one by one (so stop strings, stop
tokens and max_tokens end the sequence exactly where one-token decoding would), and the
scheduler rolls the KV back to the accepted length (``KVCacheManager.truncate``).
"""
