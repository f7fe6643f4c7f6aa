"""Prefill chunks never end inside an image's span.

An image's soft tokens attend to each other both ways (Gemma 3), so all of a span's keys must
exist when any of its queries run: a chunk that ended inside a span would compute its first
tokens without the later ones. A chunk cut short by the step's token budget is therefore cut
back to the start of the span it would split; when it starts inside that span (the span's
first tokens were a prefix-cache hit), it waits for a step with room for the span's rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.params.prompt_image import PromptImage


def fit_chunk(images: Sequence[PromptImage], start: int, num_new: int, remaining: int) -> int:
    """How many of the ``num_new`` tokens from position ``start`` to compute (``remaining``:
    the tokens left to compute from ``start``); 0 means none this step."""
    if not images or num_new >= remaining:
        return num_new
    end = start + num_new
    for image in images:
        if image.offset < end < image.end:
            return max(image.offset - start, 0)
    return num_new


def chunk_images(images: Sequence[PromptImage], start: int, num_new: int
                 ) -> tuple[PromptImage, ...]:
    """The images with placeholders among positions ``[start, start + num_new)``."""
    if not images:
        return ()
    end = start + num_new
    return tuple(i for i in images if i.overlaps(start, end))
