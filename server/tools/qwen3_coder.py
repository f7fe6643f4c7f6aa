"""``qwen3_coder`` (Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5): XML calls with raw-text values,

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

one ``<tool_call>`` block per call (a bare ``<function=...>...</function>`` is read too, as
vLLM's parser does). A value is the text between its tags, less one whitespace character at
each end, converted to the type the tool's JSON schema gives the parameter as vLLM's parser
does (:func:`convert_value`). The constraint is xgrammar's ``qwen_3_coder`` tag."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.tools.base import DecodedCall, Schemas, ToolCallFormat

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_WS = " \n\r\t"
_STRING_TYPES = {"string", "str", "text", "varchar", "char"}


@dataclass(frozen=True)
class Qwen3CoderFormat(ToolCallFormat):
    def render_call(self, name: str, arguments: Any) -> str:
        if isinstance(arguments, Mapping):
            params = "".join(f"{PARAMETER}{k}>\n{_value_text(v)}\n{PARAMETER_END}\n"
                             for k, v in arguments.items())
        else:  # the default prompt's example
            params = f"{PARAMETER}<parameter-name>>\n<value>\n{PARAMETER_END}\n"
        return f"{TOOL_CALL}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{TOOL_CALL_END}"

    def how_to_call(self) -> str:
        return ("To call a function, reply with one block per call: the function's name, then "
                "each argument in a <parameter=...> tag of its own, its value as plain text "
                "(JSON for objects and arrays):\n{example}")

    def block_end(self, text: str) -> int | None:
        end = TOOL_CALL_END if text.startswith(TOOL_CALL) else FUNCTION_END
        at = text.find(end)
        return None if at < 0 else at + len(end)

    def decode_calls(self, block: str, schemas: Schemas | None = None
                     ) -> tuple[DecodedCall, ...] | None:
        inner = block[len(TOOL_CALL):] if block.startswith(TOOL_CALL) else block
        found = list(_FUNCTION.finditer(inner))
        if not found:
            return None
        calls = []
        for m in found:
            name = m.group(1).strip()
            properties = _properties((schemas or {}).get(name))
            args = {k: convert_value(v, properties.get(k)) for k, v in _parameters(m.group(2))}
            calls.append(DecodedCall(name, args))
        return tuple(calls)


def _properties(schema: Any) -> Mapping[str, Any]:
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return props if isinstance(props, Mapping) else {}


def _parameters(body: str) -> list[tuple[str, str]]:
    """``(name, raw value)`` of each ``<parameter=name>value</parameter>`` in a function's
    body (a parameter left open runs to the next one or to the end)."""
    out = []
    for piece in body.split(PARAMETER)[1:]:
        name, sep, rest = piece.partition(">")
        if not sep:
            continue
        value = rest.split(PARAMETER_END, 1)[0]
        out.append((name.strip(), _trim(value)))
    return out


def _trim(value: str) -> str:
    """Less one whitespace character at each end (the newlines around a value)."""
    if value[:1] and value[0] in _WS:
        value = value[1:]
    if value[-1:] and value[-1] in _WS:
        value = value[:-1]
    return value


def _types(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, or its ``anyOf`` / ``oneOf``
    members' types), lower-cased, in order."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind.strip().lower()]
    if isinstance(kind, Sequence):
        return [str(k).strip().lower() for k in kind]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            if isinstance(member, Mapping):
                out += [t for t in _types(member) if t not in out]
    return out


def convert_value(raw: str, schema: Any) -> Any:
    """A raw parameter value as the type ``schema`` (the parameter's JSON schema, None when
    the tool does not declare it) gives it, as vLLM's ``qwen3_coder`` parser does:

    * ``string`` (or a type list holding it, or no schema for the parameter): the text as is;
    * ``null`` (any case) for a parameter that is not only a string: None;
    * ``integer``: an int; ``number``: an int when integral, else a float; ``boolean``:
      ``true``/``false`` (any case);
    * ``object`` / ``array`` (and anything else): JSON, else a Python literal, else the text;
    * an ``enum`` or ``const`` without a type: the JSON value when it is one of them, else the
      text;
    * a value that does not convert stays the text (and the call still counts)."""
    if not isinstance(schema, Mapping):
        return raw
    types = _types(schema)
    text = raw.strip()
    if not types:
        choices = schema["enum"] if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if "const" in schema else None)
        if choices is None:
            return raw
        value = _loads(text)
        return value if value is not _NOT and value in choices else raw
    if any(t in _STRING_TYPES for t in types):
        return None if text.lower() == "null" and "null" in types else raw
    if text.lower() == "null":
        return None
    for kind in types:
        value = _typed(text, kind)
        if value is not _NOT:
            return value
    return raw


_NOT = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return _NOT


def _typed(text: str, kind: str) -> Any:
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return _NOT
    if kind.startswith(("num", "float", "double")):
        try:
            value = float(text)
        except ValueError:
            return _NOT
        return int(value) if value.is_integer() and abs(value) < 2**63 else value
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), _NOT)
    value = _loads(text)
    if value is not _NOT:
        return value
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return _NOT


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


QWEN3_CODER = Qwen3CoderFormat("qwen3_coder", "qwen_3_coder", markers=(TOOL_CALL, FUNCTION),
                               prefixes=(), end_marker=TOOL_CALL_END, arguments_key="arguments")
