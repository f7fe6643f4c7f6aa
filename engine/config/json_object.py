"""Reading a config given as a JSON object (vLLM's ``--speculative-config``,
``--structured-outputs-config``): a mapping or its JSON text, checked against the fields of the
dataclass it becomes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def json_text(value: Any, name: str, example: str) -> Any:
    """``value`` parsed when it is JSON text, else as given; ValueError naming ``name`` (and
    showing ``example``) for text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc.msg} (e.g. '{example}')") from None


def json_object(value: Any, name: str, example: str, cls: type) -> dict[str, Any] | None:
    """``value`` (a dict, or JSON text) as a dict whose keys are all fields of dataclass
    ``cls``; None for JSON ``null``. ValueError naming ``name`` (and showing ``example``) for
    text that is not JSON, a value that is not an object, or unknown keys."""
    if isinstance(value, str):
        value = json_text(value, name, example)
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object; got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s): {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    return value
