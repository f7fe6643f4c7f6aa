"""The LoRA options of ``EngineConfig`` (``--enable-lora`` and friends), checked once."""

from __future__ import annotations

import json
from collections.abc import Iterable

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora_options(enable_lora: bool, max_loras: int, max_lora_rank: int,
                       lora_modules: tuple[tuple[str, str], ...], tensor_parallel_size: int,
                       speculative: bool) -> None:
    """ValueError with a message a user can act on for LoRA options that cannot be served."""
    if lora_modules and not enable_lora:
        raise ValueError("lora_modules need enable_lora (--enable-lora)")
    if not enable_lora:
        return
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1; got {max_loras}")
    if max_lora_rank < 1 or max_lora_rank > 512:
        raise ValueError(f"max_lora_rank must be in [1, 512]; got {max_lora_rank}")
    if tensor_parallel_size > 1:
        raise ValueError("LoRA adapters are not served under tensor parallelism yet: use "
                         "tensor_parallel_size 1 with enable_lora")
    if speculative:
        raise ValueError("LoRA adapters cannot be combined with speculative_config yet: "
                         "the drafts would come from the base model's cache; use one")


_FORMS = ('name=path or JSON {"name": ..., "path": ..., "base_model_name": ...} '
          "(base_model_name optional)")


def parse_lora_modules(specs: Iterable[str | tuple[str, str]] | str | None,
                       ) -> tuple[tuple[str, str], ...]:
    """``(name, path)`` per ``--lora-modules`` value, in order. Each value is ``name=path``
    (split at the first ``=``) or a JSON object with ``name`` and ``path`` (and optionally
    ``base_model_name``, accepted and not used), as vLLM takes them, or an already parsed
    ``(name, path)`` pair. Empty values are skipped. ValueError for a malformed value, an empty
    name or path, or a name given twice."""
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [specs]
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for spec in specs:
        if isinstance(spec, (tuple, list)) and len(spec) == 2:
            name, path = str(spec[0]).strip(), str(spec[1]).strip()
        elif spec is None or not str(spec).strip():
            continue
        elif str(spec).strip().startswith("{"):
            name, path = _parse_json(str(spec).strip())
        elif "=" in str(spec):
            name, _, path = str(spec).strip().partition("=")
            name, path = name.strip(), path.strip()
        else:
            raise ValueError(f"--lora-modules {spec!r}: expected {_FORMS}")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: the name and the path must both be "
                             f"non-empty ({_FORMS})")
        if name in seen:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice; each adapter "
                             "needs its own name")
        seen.add(name)
        out.append((name, path))
    return tuple(out)


def _parse_json(text: str) -> tuple[str, str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lora-modules {text!r} is not valid JSON ({e}); expected "
                         f"{_FORMS}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"--lora-modules {text!r}: expected a JSON object ({_FORMS})")
    extra = set(obj) - {"name", "path", "base_model_name"}
    if extra:
        raise ValueError(f"--lora-modules {text!r}: unknown keys {sorted(extra)}; expected "
                         f"{_FORMS}")
    name, path = obj.get("name"), obj.get("path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"--lora-modules {text!r}: name and path must be strings ({_FORMS})")
    base = obj.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
    return name.strip(), path.strip()
