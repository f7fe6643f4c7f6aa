"""Building the proposer a ``SpeculativeConfig`` names."""

from __future__ import annotations

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min or 1,
                             config.prompt_lookup_max or 1)
    raise ValueError(f"speculative method {config.method!r} has no proposer yet")
