"""Structured outputs: constrained decoding on grammar libraries (xgrammar and llguidance).

``spec``: what a request asks for (``StructuredSpec``: json schema, json_object, regex, choice,
grammar, structural tag), canonical and size-capped. ``backend``: the small interface the
engine uses (compile a spec, a per-sequence ``Matcher`` that advances, fills its row of a token
bitmask, rolls back and says when it has terminated). ``xgrammar_backend`` and
``llguidance_backend``: that interface on each library; ``routing``: each constraint served by
the library measured faster for it (``config``: vLLM's ``structured_outputs_config``).
``cache``: compiles off the engine thread, keyed by the spec's canonical text. ``masking``:
applies the constrained rows' masks to a step's logits.
"""
