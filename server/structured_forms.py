"""The request forms of a structured-output constraint, read into one ``StructuredSpec``.

Accepted (at most ONE per request, else a 400 naming both):

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM ``structured_outputs``: exactly one of ``json`` (schema), ``regex``, ``choice``,
  ``grammar`` (EBNF / GBNF), ``json_object: true``; and its older top-level ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``;
* llama.cpp ``grammar`` (GBNF) and ``json_schema``.

Every problem raises ``FieldError(param, message)`` (a 400 naming the field). Whether the
constraint compiles is checked later, by the engine's grammar cache (``server.serving``).
"""

from __future__ import annotations

from typing import Any

from engine.params.structured import StructuredSpec
from server.field_error import FieldError

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_spec(body: Any) -> StructuredSpec | None:
    """The constraint ``body`` (a chat or completion request) carries, or None."""
    found: list[tuple[str, StructuredSpec]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        spec = _structured_outputs(so)
        if spec is not None:
            found.append(("structured_outputs", spec))
    for field, kind in _GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _spec(kind, value, field)))
    for field, kind in (("grammar", "grammar"), ("json_schema", "json")):
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _spec(kind, value, field)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise FieldError(found[1][0], f"a request may carry one structured-output constraint; "
                                      f"this one has {len(found)}: {names}")
    return found[0][1] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    try:
        if kind == "json":
            return StructuredSpec.json_schema(value)
        if kind == "choice":
            return StructuredSpec.choice(value)
        if kind == "json_object":
            return StructuredSpec("json_object")
        return StructuredSpec.text(kind, value)
    except ValueError as exc:
        raise FieldError(param, str(exc)) from None


def _response_format(rf: Any) -> StructuredSpec | None:
    if not isinstance(rf, dict):
        raise FieldError("response_format", "must be an object with a 'type'")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise FieldError("response_format.json_schema",
                             "type 'json_schema' needs a json_schema object with a 'schema'")
        schema = js.get("schema")
        if schema is None:
            raise FieldError("response_format.json_schema.schema", "is required")
        return _spec("json", schema, "response_format.json_schema.schema")
    raise FieldError("response_format.type", f"must be 'text', 'json_object' or 'json_schema'; "
                                             f"got {kind!r}")


def _structured_outputs(so: Any) -> StructuredSpec | None:
    if not isinstance(so, dict):
        raise FieldError("structured_outputs", "must be an object")
    if so.get("whitespace_pattern") is not None:
        raise FieldError("structured_outputs.whitespace_pattern",
                         "is not supported: JSON is generated with compact separators")
    unknown = sorted(k for k in so if k not in _VLLM_KEYS and k != "whitespace_pattern"
                     and so[k] is not None)
    if unknown:
        raise FieldError(f"structured_outputs.{unknown[0]}",
                         f"is not supported; use one of {', '.join(_VLLM_KEYS)}")
    given = [k for k in _VLLM_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise FieldError("structured_outputs", f"give exactly one of {', '.join(_VLLM_KEYS)}; "
                                               f"got {', '.join(given)}")
    if not given:
        return None
    key = given[0]
    return _spec(key, so[key], f"structured_outputs.{key}")
