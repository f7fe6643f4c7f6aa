"""Reasoning output: a thinking model's thought apart from its answer (``--reasoning-parser``).

``formats``: the markers each model family writes its thinking between, and the choice of one
from the chat template. ``splitter``: a model's output, whole or streamed, cut into reasoning and
content without ever splitting a marker between the two. ``fields``: what the endpoints add
(``reasoning_content``, ``usage...reasoning_tokens``).
"""
