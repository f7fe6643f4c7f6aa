"""The conversation as the chat template gets it, tools included.

A template that references ``tools`` renders them itself (HF ``apply_chat_template`` style):
it gets ``tools=[...]`` (OpenAI's function-tool objects), assistant messages with
``tool_calls`` (``function.arguments`` a dict where the JSON string holds an object, or the
text for a template that joins it to text, DeepSeek's; ``content`` "" when null) and ``tool``
messages with ``tool_call_id``, ``name`` and ``content``. Call ids reach the template as the
format writes them (mistral's: 9 letters and digits).

A template that does not (the embedded SmolLM2's ChatML) gets kvserve's default tool prompt in
plain messages: ``DEFAULT_PREAMBLE`` (the tools as JSON lines inside ``<tools></tools>`` and
how the format writes a call: ``ToolCallFormat.how_to_call``) appended to the first system
message or as one of its own first; an assistant message's calls written into its content the
same way, after its text; ``tool`` messages as one user turn of ``<tool_response>`` blocks per
run of consecutive results."""

from __future__ import annotations

import json
import re
from typing import Any

from server.tools.base import ToolCallFormat
from server.tools.mistral import MistralFormat

DEFAULT_PREAMBLE = """# Tools

You may call one or more functions to answer. The functions, one JSON object each, are listed \
inside <tools></tools>:
<tools>
{tools}
</tools>

{how}"""
_HOW_BLOCK = ("To call a function, reply with one block per call, each holding a JSON object "
              "with the function's name and its arguments:\n{example}")
_HOW_JSON = ("To call a function, reply with only a JSON object with the function's name and "
             "its arguments:\n{example}")
_HOW_MISTRAL = ("To call functions, reply with [TOOL_CALLS] and a JSON array of the calls, each "
                "an object with the function's name and its arguments:\n{example}")
_HOW_MISTRAL_V11 = ("To call a function, reply with [TOOL_CALLS], the function's name, [ARGS] and "
                    "its arguments object, once per call:\n{example}")
_TOOLS_VAR = re.compile(r"\btools\b")


def template_source(tokenizer: Any) -> str | None:
    """The tokenizer's chat template text (all of a set of named templates), if any."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template references the ``tools`` variable."""
    return bool(template) and _TOOLS_VAR.search(template) is not None


def tool_conversation(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      fmt: ToolCallFormat, native: bool
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, extra apply_chat_template kwargs)`` for a conversation from
    ``server.protocol.conversation`` and the request's tools (None: none), rendered by the
    template itself (``native``) or by kvserve's default (see the module's docstring)."""
    if native:
        return _native(conversation, fmt), ({"tools": tools} if tools else {})
    return _default(conversation, tools, fmt), {}


def _call_names(conversation: list[dict[str, Any]]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in conversation
            for c in m.get("tool_calls") or ()}


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _native(conversation: list[dict[str, Any]], fmt: ToolCallFormat) -> list[dict[str, Any]]:
    names = _call_names(conversation)
    out = []
    for m in conversation:
        m = dict(m)
        if m.get("tool_calls"):
            m["content"] = m.get("content") or ""
            m["tool_calls"] = [{**c, "id": fmt.template_call_id(c["id"]), "function": {
                "name": c["function"]["name"],
                "arguments": fmt.template_arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        if m["role"] == "tool":
            m.setdefault("name", names.get(m.get("tool_call_id", ""), ""))
            if "tool_call_id" in m:
                m["tool_call_id"] = fmt.template_call_id(m["tool_call_id"])
        out.append(m)
    return out


def default_preamble(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.render_call("<function-name>", "<arguments-object>").replace(
        '"<function-name>"', "<function-name>").replace('"<arguments-object>"',
                                                        "<arguments-object>")
    if fmt.how_to_call() is not None:
        how = fmt.how_to_call()
    elif isinstance(fmt, MistralFormat):
        how = _HOW_MISTRAL_V11 if fmt.v11 else _HOW_MISTRAL
    else:
        how = _HOW_JSON if fmt.end_marker is None else _HOW_BLOCK
    how = how.format(example=example)
    return DEFAULT_PREAMBLE.format(tools=listed, how=how)


def _default(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             fmt: ToolCallFormat) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in conversation:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = fmt.render_calls([(c["function"]["name"],
                                       _arguments(c["function"]["arguments"]))
                                      for c in m["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        preamble = default_preamble(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}"
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
