"""Tiny random base models with PEFT LoRA adapters made by ``peft`` itself, and HF + PEFT's
merged models as the truth (``merge_and_unload``): shared by the LoRA engine tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loading.hf_reference import load_hf

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class PeftAdapter:
    name: str
    path: Path
    merged: torch.nn.Module  # HF base with this adapter merged in: the reference


def make_peft_adapter(base_dir: Path, out_dir: Path, name: str, *, seed: int, r: int,
                      alpha: float, targets: list[str], std: float = 0.3,
                      use_rslora: bool = False) -> PeftAdapter:
    """A PEFT adapter of random A and B (std ``std``: large enough to change greedy tokens)
    on the HF model at ``base_dir``, saved to ``out_dir / name``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    model = get_peft_model(load_hf(base_dir), config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.normal_(0.0, std)
    path = out_dir / name
    model.save_pretrained(path)
    return PeftAdapter(name, path, model.merge_and_unload().eval())
