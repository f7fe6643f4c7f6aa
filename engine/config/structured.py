"""``StructuredOutputsConfig``: vLLM's ``structured_outputs_config``, as far as kvserve has it.

``backend``: ``auto`` (each constraint served by the library measured faster for it:
engine.structured.routing), ``xgrammar``, or ``llguidance`` (vLLM's ``guidance`` too). Given as
a dict, its JSON text, or an instance; unknown keys are refused. ``jump_forward_tokens``: at
most this many forced tokens proposed as a draft per sequence and step (0: off;
engine.structured.jump_forward); ``jump_forward_max_seqs``: only in steps where at most this
many sequences decode (null: any; defaults: docs/structured-outputs.md, "Jump-forward drafts").

Bounds on one constraint's cost (docs/structured-outputs.md, "Limits"): ``compile_timeout`` CPU
seconds to vet it (then a 400; engine.structured.vet_worker), ``max_pending_compiles`` waiting,
a quarter per client (more: 503), ``mask_timeout`` seconds for one row's mask in a step (then
that request ends; engine.structured.mask_filler). ``isolation``: ``process`` (default) vets in
a child process the deadline kills; ``thread`` on the compile thread with no kill (tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config.json_object import json_object

BACKENDS = ("auto", "xgrammar", "llguidance")
_ALIASES = {"guidance": "llguidance"}
MAX_JUMP_FORWARD_TOKENS = 16
DEFAULT_JUMP_FORWARD_TOKENS = 8
DEFAULT_JUMP_FORWARD_MAX_SEQS = 4
ISOLATION = ("process", "thread")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    jump_forward_tokens: int = DEFAULT_JUMP_FORWARD_TOKENS
    jump_forward_max_seqs: int | None = DEFAULT_JUMP_FORWARD_MAX_SEQS
    compile_timeout: float = 5.0
    max_pending_compiles: int = 8
    mask_timeout: float = 1.0
    isolation: str = "process"

    def __post_init__(self) -> None:
        for name in ("compile_timeout", "mask_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"structured_outputs_config {name} must be a positive number "
                                 f"of seconds; got {value!r}")
        if not _is_int(self.max_pending_compiles) or self.max_pending_compiles < 1:
            raise ValueError(f"structured_outputs_config max_pending_compiles must be an "
                             f"integer >= 1; got {self.max_pending_compiles!r}")
        if self.isolation not in ISOLATION:
            raise ValueError(f"structured_outputs_config isolation must be one of "
                             f"{', '.join(ISOLATION)}; got {self.isolation!r}")
        k, b = self.jump_forward_tokens, self.jump_forward_max_seqs
        if not _is_int(k) or not 0 <= k <= MAX_JUMP_FORWARD_TOKENS:
            raise ValueError(f"structured_outputs_config jump_forward_tokens must be an integer "
                             f"in 0..{MAX_JUMP_FORWARD_TOKENS} (0: off); got {k!r}")
        if b is not None and (not _is_int(b) or b < 1):
            raise ValueError(f"structured_outputs_config jump_forward_max_seqs must be an "
                             f"integer >= 1 (or null: any batch size); got {b!r}")
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
