"""After sampling, per request: incremental detokenising, stop checks and building RequestOutputs."""
