"""``deepseek_v3`` and ``deepseek_v31`` (vLLM's names): DeepSeek's calls, all in one block
between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>`` (special tokens: the output is
decoded with special tokens kept), one ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` per call:

* V3 (and R1): ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, calls
  separated by a newline; xgrammar's ``deepseek_r1`` tag;
* V3.1 (and V3.2-Exp): ``NAME<｜tool▁sep｜>{...}``, calls back to back; ``deepseek_v3_1`` tag.

Both forms are read whichever the model writes; the format's name decides which kvserve writes
and constrains. A block counts when every call in it is complete (a block cut short by the end
of the output keeps its finished calls only if nothing follows them but whitespace). Past calls
reach the template with ``arguments`` as JSON text (DeepSeek's official templates join it to
text; a template that writes them ``|tojson`` gets a dict)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.tools.base import DecodedCall, Schemas, ToolCallFormat, _json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_V3_CALL = re.compile(r"\s*(\S+?)\s*\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)
_ARGUMENTS_TOJSON = re.compile(r"arguments['\"]?\]?\s*\|\s*tojson")


@dataclass(frozen=True)
class DeepSeekFormat(ToolCallFormat):
    v31: bool = False  # write and constrain V3.1's NAME<｜tool▁sep｜>{...} calls
    arguments_text: bool = True  # past calls' arguments reach the template as JSON text

    def for_template(self, template: str) -> DeepSeekFormat:
        return dataclasses.replace(self,
                                   arguments_text=not _ARGUMENTS_TOJSON.search(template))

    def template_arguments(self, arguments: str) -> Any:
        return arguments if self.arguments_text else super().template_arguments(arguments)

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        def args(value: Any) -> str:
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

        if self.v31:
            body = "".join(f"{CALL_BEGIN}{name}{SEP}{args(a)}{CALL_END}" for name, a in calls)
        else:
            body = "\n".join(f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args(a)}\n```{CALL_END}"
                             for name, a in calls)
        return f"{CALLS_BEGIN}{body}{CALLS_END}"

    def how_to_call(self) -> str:
        return ("To call functions, reply with the calls in this form (one "
                f"{CALL_BEGIN}...{CALL_END} per call, its arguments a JSON object):\n{{example}}")

    def block_end(self, text: str) -> int | None:
        at = text.find(CALLS_END)
        return None if at < 0 else at + len(CALLS_END)

    def decode_calls(self, block: str, schemas: Schemas | None = None
                     ) -> tuple[DecodedCall, ...] | None:
        inner = block[len(CALLS_BEGIN):] if block.startswith(CALLS_BEGIN) else block
        inner = inner.rstrip()
        if inner.endswith(CALLS_END):
            inner = inner[:-len(CALLS_END)]
        calls = []
        rest = inner
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(CALL_BEGIN):
                return None
            end = rest.find(CALL_END)
            if end < 0:
                return None
            call = _decode_call(rest[len(CALL_BEGIN):end])
            if call is None:
                return None
            calls.append(call)
            rest = rest[end + len(CALL_END):]
        return tuple(calls) or None


def _decode_call(text: str) -> DecodedCall | None:
    """One call's text between its begin and end markers, in either form."""
    head, sep, tail = text.partition(SEP)
    if not sep:
        return None
    v3 = _V3_CALL.fullmatch(tail)
    if v3 is not None and head.strip() == "function":
        name, args = v3.group(1), _json(v3.group(2).strip())
    else:
        name, args = head.strip(), _json(tail.strip())
    if not name or not isinstance(args, dict):
        return None
    return DecodedCall(name, args)


_COMMON = dict(xgrammar_key=None, markers=(CALLS_BEGIN,), prefixes=(CALLS_BEGIN,),
               end_marker=CALLS_END, arguments_key="arguments", special_marker=True)
DEEPSEEK_V3 = DeepSeekFormat("deepseek_v3", **{**_COMMON, "xgrammar_key": "deepseek_r1"})
DEEPSEEK_V31 = DeepSeekFormat("deepseek_v31", **{**_COMMON, "xgrammar_key": "deepseek_v3_1"},
                              v31=True)
