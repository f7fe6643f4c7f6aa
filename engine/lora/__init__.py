"""LoRA adapters served beside the base model: adapter files, device slots, the batched delta."""
