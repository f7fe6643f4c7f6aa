"""Tool-call output formats: how a model writes a call, named as vLLM's ``--tool-call-parser``.

* ``hermes`` (kvserve's default; Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{json}</tool_call>``
  per call; ``llama3_json`` (Llama 3.1+): a bare ``{"name", "parameters"}`` object;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls (tokenizers before v11) or
  ``name[ARGS]{...}`` per call (v11+); both read, the template's form written and constrained;
* ``qwen3_coder`` (server/tools/qwen3_coder.py), ``deepseek_v3`` / ``deepseek_v31``
  (server/tools/deepseek.py), ``openai`` (gpt-oss's harmony channels: server/tools/harmony.py),
  ``granite`` and ``phi4_mini_json`` (a marker and a JSON array: server/tools/json_array.py).

A format (server/tools/base.py) knows the strings that open a call, where a call block ends,
how to read one and how to write a message's calls; each format's docstring or class spells
out its syntax and its xgrammar tag (server/tools/constraint.py). ``choose_format`` picks one
for a chat template when the operator names none. Formats whose markers are special tokens
decode the output with special tokens kept."""

from __future__ import annotations

import re

from server.tools.base import DecodedCall, ToolCallFormat
from server.tools.deepseek import DEEPSEEK_V3, DEEPSEEK_V31
from server.tools.harmony import HARMONY
from server.tools.json_array import GRANITE, PHI4_MINI_JSON
from server.tools.mistral import MISTRAL, MISTRAL_V11, MistralFormat
from server.tools.qwen3_coder import QWEN3_CODER

__all__ = ["DecodedCall", "FORMATS", "HERMES", "LLAMA3_JSON", "MISTRAL", "MISTRAL_V11",
           "PARSER_NAMES", "MistralFormat", "ToolCallFormat", "choose_format"]

HERMES = ToolCallFormat("hermes", "qwen_3", markers=("<tool_call>",), prefixes=("<tool_call>",),
                        end_marker="</tool_call>", arguments_key="arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "llama", markers=('{"name"', "<|python_tag|>"),
                             prefixes=("<|python_tag|>",), end_marker=None,
                             arguments_key="parameters")
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, DEEPSEEK_V3, DEEPSEEK_V31, HARMONY, GRANITE,
    PHI4_MINI_JSON)}
PARSER_NAMES = tuple(FORMATS)

_LLAMA_HINTS = re.compile(r'"parameters"|<\|python_tag\|>|ipython')
# What a template writes that names its format beyond doubt, checked in this order (before
# <tool_call>, which Qwen3-Coder's template writes too).
_TEMPLATE_HINTS: tuple[tuple[tuple[str, ...], ToolCallFormat, str], ...] = (
    (("<|channel|>", "<|message|>"), HARMONY, "the chat template writes harmony's channels"),
    (("<｜tool▁calls▁begin｜>", "```json"), DEEPSEEK_V3,
     "the chat template writes DeepSeek V3 calls (<｜tool▁calls▁begin｜>, ```json)"),
    (("<｜tool▁calls▁begin｜>",), DEEPSEEK_V31,
     "the chat template writes DeepSeek V3.1 calls (<｜tool▁calls▁begin｜>, no ```json)"),
    (("<function=", "<parameter="), QWEN3_CODER,
     "the chat template writes Qwen3-Coder XML calls (<function=, <parameter=)"),
    (("<|tool_call|>",), GRANITE, "the chat template writes Granite's <|tool_call|>"),
    (("functools",), PHI4_MINI_JSON, "the chat template writes Phi-4-mini's functools[...]"),
)


def choose_format(template: str | None, given: str | None = None) -> tuple[ToolCallFormat, str]:
    """The format to parse and constrain calls with, and why (for the start-up log): the one
    ``given`` (``--tool-call-parser``), else from the chat template: one that mentions
    ``[TOOL_CALLS]`` is mistral; ``<|channel|>`` and ``<|message|>`` openai (harmony);
    ``<｜tool▁calls▁begin｜>`` deepseek_v3 with ```` ```json ````, else deepseek_v31;
    ``<function=`` and ``<parameter=`` qwen3_coder; ``<|tool_call|>`` granite; ``functools``
    phi4_mini_json; ``<tool_call>`` hermes; ``"parameters"``,
    ``<|python_tag|>`` or ``ipython`` llama3_json; anything else hermes (kvserve's default
    prompt format).
    Mistral writes ``name[ARGS]{...}`` calls when the template mentions ``[ARGS]``."""
    if given is not None and given not in FORMATS:
        raise ValueError(f"unknown tool-call parser {given!r}; one of {', '.join(PARSER_NAMES)}")
    text = template or ""
    if given == "mistral" or (given is None and "[TOOL_CALLS]" in text):
        v11 = "[ARGS]" in text
        return (MISTRAL_V11 if v11 else MISTRAL), (
            ("--tool-call-parser" if given else "the chat template writes [TOOL_CALLS]")
            + (", calls as name[ARGS]{...} (the template writes [ARGS])" if v11 else ""))
    if given is not None:
        return FORMATS[given].for_template(text), "--tool-call-parser"
    for needles, fmt, why in _TEMPLATE_HINTS:
        if all(n in text for n in needles):
            return fmt.for_template(text), why
    if "<tool_call>" in text:
        return HERMES, "the chat template writes <tool_call> blocks"
    if _LLAMA_HINTS.search(text):
        return LLAMA3_JSON, "the chat template writes Llama 3 JSON calls"
    return HERMES, "the chat template has no tool-call format of its own: kvserve's default"
