"""Structured outputs: constrained decoding on a grammar library (xgrammar).

``spec``: what a request asks for (``StructuredSpec``: json schema, json_object, regex, choice,
grammar), canonical and size-capped. ``backend``: the small interface the engine uses (compile a
spec, a per-sequence ``Matcher`` that advances, fills its row of a token bitmask, rolls back and
says when it has terminated). ``xgrammar_backend``: that interface on xgrammar, chosen by
measurement (benchmarks/grammar_backends.py). ``cache``: compiles off the engine thread, keyed by
the spec's canonical text. ``masking``: applies the constrained rows' masks to a step's logits.
"""
