"""Output side of a step: incremental detokenising, stop checks and building RequestOutputs."""
