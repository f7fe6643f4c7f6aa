"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated into a
``ToolSet``; and the check that every ``tool`` message answers an earlier call.

Rules (each break is a ``FieldError``, a 400 naming the field):

* ``tools``: at most ``MAX_TOOLS`` (128) function tools, ``{"type": "function", "function":
  {"name", "description"?, "parameters"?, "strict"?}}``; a name matches
  ``^[a-zA-Z0-9_-]{1,64}$`` and is unique; ``parameters`` is a JSON schema of an object (a
  mapping whose ``type``, if given, is ``"object"``; left out: no arguments). ``strict`` is
  accepted and ignored: arguments are always constrained to the schema.
* ``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
  ``{"type": "function", "function": {"name": N}}`` naming one of ``tools``; ``required`` and a
  named function need tools.
* ``parallel_tool_calls`` (default true): false allows at most one call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from server.field_error import FieldError

MAX_TOOLS = 128
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's chat API (and HF chat templates, and xgrammar) write it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


class ToolNames(frozenset):
    """The request's function names, carrying their ``parameters`` schemas by name
    (``schemas``): the qwen3_coder parser types its raw values by them."""

    schemas: dict[str, dict[str, Any]]

    def __new__(cls, tools: Iterable[FunctionTool]) -> ToolNames:
        tools = tuple(tools)
        names = super().__new__(cls, (t.name for t in tools))
        names.schemas = {t.name: t.parameters for t in tools}
        return names


@dataclass(frozen=True)
class ToolSet:
    tools: tuple[FunctionTool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None  # the function a named tool_choice forces
    parallel: bool

    @property
    def names(self) -> ToolNames:
        return ToolNames(self.tools)

    @property
    def calls_expected(self) -> bool:
        """Whether the output is constrained and parsed for calls (not ``none``)."""
        return self.choice != "none" and bool(self.tools)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]


def read_tool_set(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSet | None:
    """The request's tool set, or None when it has no tools and no tool_choice to honour."""
    parsed = _tools(tools) if tools is not None else ()
    choice, named = _choice(tool_choice, {t.name for t in parsed}, bool(parsed))
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise FieldError("parallel_tool_calls", "must be true or false")
    if not parsed:
        return None
    return ToolSet(parsed, choice, named, parallel_tool_calls is not False)


def _tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list):
        raise FieldError("tools", "must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"{len(tools)} tools; at most {MAX_TOOLS} are allowed")
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f"{where}.type", "only function tools are supported: "
                                              '{"type": "function", "function": {...}}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{where}.function", "must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"{where}.function.name",
                             "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
        if name in seen:
            raise FieldError(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise FieldError(f"{where}.function.description", "must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise FieldError(f"{where}.function.parameters",
                             "must be a JSON schema of an object ({\"type\": \"object\", "
                             "\"properties\": {...}})")
        out.append(FunctionTool(name, desc, params))
    return tuple(out)


def _choice(choice: Any, names: set[str], has_tools: bool) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise FieldError("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                                            '{"type": "function", "function": {"name": ...}}')
        if choice == "required" and not has_tools:
            raise FieldError("tool_choice", "'required' needs tools")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise FieldError("tool_choice", 'a named tool choice is {"type": "function", '
                                        '"function": {"name": ...}}')
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise FieldError("tool_choice.function.name", "is required")
    if name not in names:
        raise FieldError("tool_choice.function.name",
                         f"names {name!r}, which is not one of the request's tools")
    return "named", name


def check_tool_results(messages: Iterable[Any]) -> None:
    """Every ``tool`` message's ``tool_call_id`` is the id of a call in an earlier assistant
    message (the history of a tool loop); else a 400 naming the message."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            seen.update(c.id for c in m.tool_calls or ())
        elif m.role == "tool" and m.tool_call_id not in seen:
            raise FieldError(f"messages.{i}.tool_call_id",
                             f"{m.tool_call_id!r} matches no tool call of an earlier "
                             f"assistant message")
