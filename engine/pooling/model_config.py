"""How a model says its embeddings are pooled.

Read once at start, in this order: sentence-transformers' ``modules.json`` (a ``Pooling``
module's ``1_Pooling/config.json`` ``pooling_mode_*`` flags; a ``Normalize`` module means
normalised vectors), then a GGUF's ``{arch}.pooling_type`` (llama.cpp: 1 mean, 2 cls, 3 last,
4 rank), else the default: last-token pooling, normalised, for a model served for
embeddings (``task="embed"``, Qwen3-Embedding's shape), mean pooling, normalised, for a
generative model asked for embeddings (``task="generate"``: a demonstration, not a
retrieval model).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.loading.gguf_fields import gguf_reader

logger = logging.getLogger("kvserve.engine")

# llama.cpp's enum llama_pooling_type (0 none: token embeddings, which kvserve does not serve)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "last"}
_ST_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))


@dataclass(frozen=True, slots=True)
class ModelPooling:
    """The model's pooling rule and where it was read (for the start-up log)."""

    method: str
    normalize: bool
    source: str

    def describe(self) -> str:
        return (f"pooling {self.method}{', normalised' if self.normalize else ''} "
                f"({self.source})")


def read_model_pooling(model_dir: Path, task: str, gguf_path: Path | None = None
                       ) -> ModelPooling:
    """The pooling rule of the model in ``model_dir`` (``gguf_path``: the GGUF it was
    converted from, if any) served for ``task`` ("embed", "score" or "generate")."""
    found = _sentence_transformers(Path(model_dir))
    if found is not None:
        return found
    if gguf_path is not None:
        found = _gguf(gguf_path)
        if found is not None:
            return found
    if task == "generate":
        return ModelPooling("mean", True, "default for a generative model: a demonstration")
    return ModelPooling("last", True, "default for a decoder embedding model")


def _sentence_transformers(model_dir: Path) -> ModelPooling | None:
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list):
        return None
    method, normalize = None, False
    for m in modules:
        if not isinstance(m, dict):
            continue
        kind = str(m.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            try:
                cfg = json.loads((model_dir / str(m.get("path", "")) / "config.json")
                                 .read_text())
            except (OSError, ValueError):
                cfg = {}
            method = next((name for key, name in _ST_MODES if cfg.get(key)), None)
            if method is None and cfg:
                logger.warning("%s: pooling mode %s is not served; using last-token pooling",
                               model_dir, {k: v for k, v in cfg.items() if v is True})
    if method is None:
        return None
    return ModelPooling(method, normalize, "sentence-transformers modules.json")


def _gguf(gguf_path: Path) -> ModelPooling | None:
    try:

        reader = gguf_reader(gguf_path)
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
        field = reader.fields.get(f"{arch}.pooling_type")
        if field is None:
            return None
        value = int(field.parts[field.data[0]][0])
    except Exception:  # noqa: BLE001 - an unreadable field: the default applies
        return None
    method = GGUF_POOLING.get(value)
    if method is None:
        return None
    return ModelPooling(method, True, f"GGUF pooling_type {value}")
