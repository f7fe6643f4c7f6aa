"""Chat templates for models that carry none, and ``--chat-template``.

Many GGUF files carry no ``tokenizer.chat_template`` (the real Gemma 3 270M Q4_K_M among them):
llama.cpp's server then applies a template it knows for the architecture, and so does kvserve.
The templates are text files in ``engine/loading/chat_templates/`` (Gemma, Llama 3, ChatML for
Qwen and SmolLM, Mistral/Llama 2's ``[INST]``), without tool definitions; one is chosen from
the model's special tokens first (``<start_of_turn>``, ``<|start_header_id|>``, ``<|im_start|>``,
``[INST]``: what the tokenizer says outweighs the architecture, which fine-tunes keep while
changing the format), else from its ``model_type`` (from the GGUF's ``general.architecture``).
The choice is logged. ``--chat-template`` (vLLM's flag) overrides the model's own template or
the built-in one: a file path, a built-in's name, or the template text itself.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

BUILTIN = ("gemma", "llama3", "chatml", "mistral")
# (special token, template): the first the vocabulary holds wins.
_TOKEN_HINTS = (("<start_of_turn>", "gemma"), ("<|start_header_id|>", "llama3"),
                ("<|im_start|>", "chatml"), ("[INST]", "mistral"))
# (model_type prefix, template) when no token decides.
_TYPE_HINTS = (("gemma", "gemma"), ("qwen", "chatml"), ("mistral", "mistral"),
               ("mixtral", "mistral"), ("llama", "mistral"))
_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ping"},
          {"role": "assistant", "content": "pong"}, {"role": "user", "content": "ping"}]


def builtin_text(name: str) -> str:
    """The text of built-in template ``name`` (one of :data:`BUILTIN`)."""
    return (resources.files("engine.loading") / "chat_templates" / f"{name}.jinja").read_text(
        encoding="utf-8")


def model_type(model_dir: Path) -> str:
    try:
        return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
                   or "")
    except (OSError, ValueError):
        return ""


def choose(model_type_: str, tokenizer: Any) -> tuple[str, str] | None:
    """``(template name, why)`` for a model without a template, or None when nothing fits."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: the type alone
        vocab = {}
    for token, name in _TOKEN_HINTS:
        if token in vocab:
            return name, f"its vocabulary has {token}"
    for prefix, name in _TYPE_HINTS:
        if model_type_.startswith(prefix):
            return name, f"model_type {model_type_}"
    return None


def resolve_override(value: str) -> tuple[str, str]:
    """``--chat-template``'s value as ``(what it is, template text)``: a built-in's name, a file
    path, or the template text; ValueError for a path-like value that names no file."""
    value = str(value)
    if value in BUILTIN:
        return f"the built-in {value} template", builtin_text(value)
    if "{{" in value or "{%" in value:
        return "the template text given", value
    path = Path(value).expanduser()
    if path.is_file():
        return f"the template in {path}", path.read_text(encoding="utf-8")
    raise ValueError(f"--chat-template {value!r}: no such file, not a built-in template "
                     f"({', '.join(BUILTIN)}) and no Jinja template text ({{{{ or {{%)")


def check_renders(tokenizer: Any, what: str) -> None:
    """Render a short conversation with the tokenizer's template: a broken one fails the start
    (ValueError naming ``what``), not the first chat request."""
    try:
        tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja's errors, a template's raise_exception
        raise ValueError(f"chat template ({what}) does not render a simple conversation: "
                         f"{exc}") from None
