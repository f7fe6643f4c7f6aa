"""Pooling requests: prefill only, one pooled hidden state (or a few head logits) back.

``params``: what a request asks (``PoolingParams``, carried on ``SamplingParams.pooling``);
``model_config``: what the model says (sentence-transformers' ``modules.json`` and
``1_Pooling/config.json``, GGUF's ``pooling_type``); ``span``: which rows of a scheduled
chunk the runner pools; ``accumulate``: the per-request sum across chunks and the final
vector (mean, normalisation, Matryoshka truncation). See docs/embeddings.md.
"""
