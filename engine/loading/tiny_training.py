"""Tiny models that have learned something: a few hundred AdamW steps of next-token prediction
on the repository's own docs (docs/*.md, ~190k tokens of English), for measurements whose
random-weight versions are dominated by near-tied logits (tests/engine/loading/test_moe_gguf.py,
benchmarks/gguf_agreement.py ``--trained``). Seconds to a minute a model on two cores;
deterministic for a seed on one machine."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

DOCS = Path(__file__).resolve().parents[2] / "docs"


def docs_tokens(tokenizer, text: str | None = None) -> torch.Tensor:
    """``text`` (default: docs/*.md as they are now, concatenated) as token ids. A test that
    holds a trained model to a threshold passes a frozen text: the docs change with every
    commit, and with them the trained weights and the figure."""
    if text is None:
        text = "".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False))


def train(model, tokens: torch.Tensor, steps: int, seed: int = 0, batch: int = 16,
          length: int = 64, lr: float = 3e-3):
    """``model`` (an HF causal LM, float32) trained in place on random windows of ``tokens``;
    returned in eval mode."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    bar = tqdm(range(steps), desc=f"training {model.config.model_type}", leave=False)
    for _ in bar:
        at = torch.randint(0, len(tokens) - length - 1, (batch,), generator=g)
        x = torch.stack([tokens[i:i + length] for i in at])
        y = torch.stack([tokens[i + 1:i + length + 1] for i in at])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.2f}")
    return model.eval()
