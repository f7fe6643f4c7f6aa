"""Structured outputs: constrained decoding on grammar libraries (xgrammar and llguidance).

``spec``: what a request asks for (``StructuredSpec``: json schema, json_object, regex, choice,
grammar, structural tag), canonical, size- and depth-capped. ``backend``: the small interface the
engine uses (compile a spec, a per-sequence ``Matcher`` that advances, fills its row of a token
bitmask, rolls back and says when it has terminated). ``xgrammar_backend`` and
``llguidance_backend``: that interface on each library. A new constraint is vetted before any
request runs it: ``grammar_shape`` (can it end, how much can it force), ``vetting`` (each
library's compile and probe fills; which serves it), ``vet_worker`` (all of that in a child
process a deadline kills). ``routing``: compiles with the library chosen (``config``: vLLM's
``structured_outputs_config`` plus kvserve's bounds). ``cache``: vets and compiles off the engine
thread, keyed by the spec's canonical text, remembering refusals. ``mask_filler`` and
``masking``: a step's masks filled under a deadline per row, then applied to its logits.
"""
