"""What this engine serves pooling requests as: the task resolved, the model's pooling rule,
its hidden size and, for a yes/no reranker, the two head token ids. Built once by the core
(``EngineCore.pooling``) and read by the server's embeddings, rerank and score routes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.pooling.model_config import ModelPooling, read_model_pooling

logger = logging.getLogger("kvserve.engine")

# Qwen3-Reranker's model card: the answer is scored by the logits of these two tokens
RERANK_TOKENS = ("no", "yes")


@dataclass(frozen=True, slots=True)
class ServedPooling:
    """``task``: "generate", "embed" or "score" (never "auto"). ``rule``: how embeddings
    are pooled. ``hidden_size``: the full vector's length (``dimensions`` may not exceed it).
    ``score_token_ids``: ("no", "yes") ids for the yes/no scoring of ``task="score"``."""

    task: str
    rule: ModelPooling
    hidden_size: int
    score_token_ids: tuple[int, int] | None = None

    def describe(self) -> str:
        what = {"generate": "generation; /v1/embeddings as a demonstration",
                "embed": "embeddings; rerank and score by cosine similarity",
                "score": "yes/no reranking scores"}[self.task]
        return f"task {self.task} ({what}); embeddings: {self.rule.describe()}"


def resolve_task(task: str, model_dir: Path, hf_config: Any, name: str) -> str:
    """``task`` unless "auto": then "embed" for a sentence-transformers directory, a bare
    body (``*Model`` architectures) or a name with "embed" in it; "score" for a name with
    "rerank" in it; else "generate"."""
    if task != "auto":
        return task
    lowered = name.lower()
    if "rerank" in lowered:
        return "score"
    archs = list(getattr(hf_config, "architectures", None) or [])
    if ((Path(model_dir) / "modules.json").is_file() or "embed" in lowered
            or any(a.endswith("Model") for a in archs)):
        return "embed"
    return "generate"


def head_token_id(tokenizer: Any, word: str) -> int:
    """The vocabulary id of ``word`` as Qwen3-Reranker's card takes it
    (``convert_tokens_to_ids``); a tokenizer without that token (a byte-level test model):
    the first token ``word`` encodes to."""
    tid = tokenizer.convert_tokens_to_ids(word)
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(tid, int) and tid >= 0 and tid != unk:
        return tid
    return int(tokenizer.encode(word, add_special_tokens=False)[0])


def served_pooling(task: str, model_dir: Path, hf_config: Any, name: str, tokenizer: Any,
                   hidden_size: int, gguf_path: Path | None = None) -> ServedPooling:
    resolved = resolve_task(task, model_dir, hf_config, name)
    rule = read_model_pooling(model_dir, resolved, gguf_path)
    ids = None
    if resolved == "score":
        no, yes = (head_token_id(tokenizer, w) for w in RERANK_TOKENS)
        ids = (no, yes)
    return ServedPooling(resolved, rule, hidden_size, ids)


def sentence_transformers_prompts(model_dir: Path) -> dict[str, str]:
    """``config_sentence_transformers.json``'s named prompts (Qwen3-Embedding's "query"),
    for the docs and clients; empty when absent."""
    try:
        cfg = json.loads((Path(model_dir) / "config_sentence_transformers.json").read_text())
        prompts = cfg.get("prompts") or {}
        return {str(k): str(v) for k, v in prompts.items()}
    except (OSError, ValueError, AttributeError):
        return {}
