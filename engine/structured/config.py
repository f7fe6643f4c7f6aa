"""``StructuredOutputsConfig``: vLLM's ``structured_outputs_config``, as far as kvserve has it.

``backend``: ``auto`` (each constraint served by the library measured faster for it:
engine.structured.routing), ``xgrammar``, or ``llguidance`` (vLLM calls it ``guidance``; both
names are taken). Given as a dict, its JSON text, or an instance; unknown keys are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.json_config import json_object

BACKENDS = ("auto", "xgrammar", "llguidance")
_ALIASES = {"guidance": "llguidance"}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"

    def __post_init__(self) -> None:
        backend = _ALIASES.get(self.backend, self.backend)
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of "
                             f"{', '.join(BACKENDS)} (or guidance); got {self.backend!r}")
        object.__setattr__(self, "backend", backend)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object this config reads back from."""
        return dataclasses.asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsConfig:
        """Normalise any accepted form; None is the default."""
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        value = json_object(value, "structured_outputs_config", '{"backend": "xgrammar"}', cls)
        if value is None:
            return cls()
        return cls(**value)
