"""``/v1/embeddings``, ``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``) and ``/v1/score``:
request models (protocol.py), prompts and scoring templates (prompts.py), the routes
(endpoint.py) and the response bodies (writer.py). Engine work is one pooling request per
input (``engine.pooling``), scheduled beside generation and sharing the prefix cache.
See docs/embeddings.md."""
