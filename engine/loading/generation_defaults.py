"""The model's own sampling defaults (vLLM's ``--generation-config``): what a request that
leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` out gets.

Sources, by ``generation_config``:

* ``auto`` (default): the model's ``generation_config.json`` (a converted GGUF's carries the
  file's ``general.sampling.*`` keys, see ``engine.loading.gguf_convert``); where it names no
  sampling value and the model is the embedded SmolLM2-135M-Instruct, its model card's settings
  (temperature 0.2, top_p 0.9), so that the README's first question gets a focused answer.
* ``vllm``: none; a request's missing fields take OpenAI's defaults (temperature 1, top_p 1).
* a directory: its ``generation_config.json``.

A request's own value always wins. Values outside what a request may send are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# generation_config.json keys kvserve applies (HF's names are the request fields' names)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# GGUF metadata (llama.cpp's general.sampling.*) -> generation_config.json keys
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
EMBEDDED_MODEL_CARD = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class GenerationDefaults:
    """``values``: field -> default for the request fields in :data:`SAMPLING_KEYS`;
    ``source``: where they came from, for the start-up log."""

    values: dict[str, float] = field(default_factory=dict)
    source: str = "none"

    def __post_init__(self) -> None:
        for key, value in self.values.items():
            _check(key, value, self.source)

    def describe(self) -> str:
        if not self.values:
            return f"sampling defaults: OpenAI's ({self.source})"
        text = ", ".join(f"{k}={v:g}" for k, v in self.values.items())
        return (f"sampling defaults {text} ({self.source}); a request's own values win; "
                f"--generation-config vllm turns them off")


def _check(key: str, value: Any, source: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and {
        "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1,
        "top_k": lambda v: v >= -1 and float(v).is_integer(), "min_p": lambda v: 0 <= v <= 1,
        "repetition_penalty": lambda v: v > 0}[key](value)
    if not ok:
        raise ValueError(f"generation config {source}: {key}={value!r} is not a valid default")


def read_sampling(path: Path) -> dict[str, float]:
    """The :data:`SAMPLING_KEYS` in ``path`` (a generation_config.json); {} when absent."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}


def generation_defaults(model_dir: Path, setting: str = "auto",
                        embedded: bool = False) -> GenerationDefaults:
    """The defaults for the model in ``model_dir`` under ``setting`` (module docstring);
    ``embedded``: the model is the embedded one. ValueError for a directory without the file
    or an invalid value."""
    if setting == "vllm":
        return GenerationDefaults({}, "--generation-config vllm")
    if setting != "auto":
        path = Path(setting).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {setting}: no generation_config.json there "
                             f"(use auto, vllm or a directory holding one)")
        return GenerationDefaults(read_sampling(path), str(path))
    values = read_sampling(model_dir / "generation_config.json")
    if values:
        return GenerationDefaults(values, "the model's generation_config.json")
    if embedded:
        return GenerationDefaults(dict(EMBEDDED_MODEL_CARD),
                                  "the embedded SmolLM2-135M-Instruct's model card")
    return GenerationDefaults({}, "the model gives none")


def gguf_sampling(reader: Any) -> dict[str, float]:
    """``general.sampling.*`` of a ``gguf.GGUFReader`` as generation_config.json keys."""
    out: dict[str, float] = {}
    for gguf_key, key in GGUF_SAMPLING_KEYS.items():
        f = reader.fields.get(gguf_key)
        if f is not None:
            value = f.contents()
            out[key] = int(value) if key == "top_k" else float(value)
    return out
