"""Options every layer reads: the engine's, and each feature's (frozen, validated, no engine imports)."""
