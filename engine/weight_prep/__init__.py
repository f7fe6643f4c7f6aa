"""Weight preparation at start: each linear packed, quantised or kept float (the formats are
``engine.quantization``'s; the checkpoint readers ``engine.loading``'s)."""
