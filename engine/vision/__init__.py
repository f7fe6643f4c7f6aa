"""Gemma 3 image input: decoding, preprocessing, the SigLIP tower and the projector to text."""
