"""A marker, then a JSON array of ``{"name": ..., "arguments": {...}}`` calls: Mistral's form
before tokenizer v11 under other markers (vLLM's names):

* ``granite`` (IBM Granite 3.x): ``<|tool_call|>[...]`` (a special token; Granite 3.1's
  ``<tool_call>[...]`` is read too);
* ``phi4_mini_json`` (Phi-4-mini): ``functools[...]``.

Parsed, written and constrained as mistral's array (server/tools/mistral.py, constraint.py's
``mistral_tag``), with ordinary ``call_...`` ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.tools.base import ToolCallFormat
from server.tools.mistral import MistralFormat


@dataclass(frozen=True)
class JsonArrayFormat(MistralFormat):
    def call_id(self) -> str:
        return ToolCallFormat.call_id(self)

    def template_call_id(self, call_id: str) -> str:
        return call_id

    def how_to_call(self) -> str:
        return (f"To call functions, reply with {self.markers[0]} and a JSON array of the calls, "
                "each an object with the function's name and its arguments:\n{example}")


GRANITE = JsonArrayFormat("granite", None, markers=("<|tool_call|>", "<tool_call>"),
                          prefixes=("<|tool_call|>", "<tool_call>"), end_marker=None,
                          arguments_key="arguments", special_marker=True)
PHI4_MINI_JSON = JsonArrayFormat("phi4_mini_json", None, markers=("functools",),
                                 prefixes=("functools",), end_marker=None,
                                 arguments_key="arguments")
