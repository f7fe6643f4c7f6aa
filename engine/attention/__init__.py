"""Attention over the paged KV cache: the metadata both backends read, the torch and Triton backends, and the chooser."""
