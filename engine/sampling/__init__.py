"""Sampling: request parameters, the per-row sampling data, penalties, the sampler and prompt logprobs."""
