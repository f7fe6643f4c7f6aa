"""Benchmarks users can run: ``kvserve bench serve`` (any OpenAI-compatible server),
``kvserve bench offline`` (the engine in-process next to HF transformers and KV-cache-off) and
``kvserve kv-calc`` (KV-cache bytes). The useful-FLOPs yardstick lives in yardstick.py."""
