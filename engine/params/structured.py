"""``StructuredSpec``: the constraint one request carries, in canonical form.

Kinds: ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
a list of strings), ``grammar`` (EBNF / GBNF text, as xgrammar takes it) and ``structural_tag``
(an xgrammar structural tag as compact JSON: free text and tagged, schema-constrained spans,
which is how tool calls are constrained, see server/tools/constraint.py). ``value`` is the
canonical text (a schema or a choice list as compact JSON with sorted keys, except a schema's
``properties``, whose order is the order the fields are generated in), so that two requests with
the same constraint share one compiled grammar. Construction raises ``ValueError`` (a 400) for a
malformed value, one longer than ``MAX_CONSTRAINT_CHARS`` or a schema or tag nested more than
``MAX_SCHEMA_DEPTH`` levels (checked before any recursive walk of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.params.json_depth import deeper_than

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A schema, regex or grammar longer than this is refused: compiling it could hold a compile
# worker for seconds, and no real tool schema comes near it.
MAX_CONSTRAINT_CHARS = 128 * 1024
MAX_CHOICES = 1024
# Containers (objects and arrays) nested in one schema or structural tag. Real schemas nest
# a few levels (OpenAI's strict mode allows 10); thousands would overflow recursive walks.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: str = ""  # canonical text; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; one of {KINDS}")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the {self.kind} constraint has {len(self.value)} characters; at "
                             f"most {MAX_CONSTRAINT_CHARS} are allowed")
        if self.kind in ("regex", "grammar", "structural_tag") and not self.value:
            raise ValueError(f"the {self.kind} constraint must not be empty")

    @property
    def key(self) -> tuple[str, str]:
        """What the compile cache is keyed by."""
        return (self.kind, self.value)

    def describe(self) -> str:
        """A short label for logs: the kind and the constraint's size."""
        return self.kind if not self.value else f"{self.kind} ({len(self.value)} chars)"

    # ---- constructors from request values --------------------------------------------------

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredSpec:
        """From a schema given as a dict, a bool or JSON text."""
        if isinstance(schema, str):
            if len(schema) > MAX_CONSTRAINT_CHARS:
                cls("json", schema)  # raises the size error
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object; got {type(schema).__name__}")
        if schema is False:
            raise ValueError("the JSON schema is false: it accepts no value at all")
        _check_depth(schema, "JSON schema")
        return cls("json", canonical_schema(schema))

    @classmethod
    def choice(cls, choices: Any) -> StructuredSpec:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ValueError("choice must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"choice has {len(choices)} entries; at most {MAX_CHOICES}")
        return cls("choice", canonical_json(choices))

    @classmethod
    def structural_tag(cls, tag: Any) -> StructuredSpec:
        """From an xgrammar ``StructuralTag`` (anything with pydantic's ``model_dump``) or its
        dict form; the value is its compact JSON with keys in their given order (not sorted: the
        tools' ``properties`` maps are generated in their order, so two orders are two
        constraints; the tag is built deterministically from the request's tools)."""
        if hasattr(tag, "model_dump"):
            tag = tag.model_dump(mode="json")
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
            raise ValueError("a structural tag must be an object with type 'structural_tag'")
        _check_depth(tag, "structural tag")
        return cls("structural_tag", json.dumps(tag, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def text(cls, kind: str, value: Any) -> StructuredSpec:
        """A ``regex`` or ``grammar`` given as a string."""
        if not isinstance(value, str):
            raise ValueError(f"the {kind} constraint must be a string")
        return cls(kind, value)


def _check_depth(value: Any, what: str) -> None:
    where = deeper_than(value, MAX_SCHEMA_DEPTH)
    if where is not None:
        raise ValueError(f"the {what} nests more than {MAX_SCHEMA_DEPTH} levels deep (at "
                         f"{where[:120]}); flatten it")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_schema(schema: Any) -> str:
    """Like ``canonical_json``, but a ``properties`` map keeps its order: xgrammar generates an
    object's fields in that order (as OpenAI's strict mode does; a "reasoning" field put before
    "answer" is meant to be written first), so two orders are two constraints."""
    return json.dumps(_sorted_keys(schema), separators=(",", ":"), ensure_ascii=False)


def _sorted_keys(value: Any, keep_order: bool = False) -> Any:
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    if not isinstance(value, dict):
        return value
    if keep_order:  # a properties map: its values are schemas
        return {k: _sorted_keys(v) for k, v in value.items()}
    return {k: _sorted_keys(value[k], k == "properties" and isinstance(value[k], dict))
            for k in sorted(value)}
