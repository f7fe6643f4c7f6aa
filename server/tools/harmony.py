"""``openai`` (vLLM's name; gpt-oss): OpenAI's harmony format, a run of messages, each later one
opened by ``<|start|>assistant``::

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

A header names the channel and, for a call, its recipient; a body runs to ``<|end|>``,
``<|call|>``, ``<|return|>`` or the end of the output. As vLLM maps them: ``analysis`` is the
reasoning; a message to ``functions.NAME`` a tool call (its body the arguments' JSON; a body that
is no JSON object, or an unknown name, is dropped); ``final`` and ``commentary`` with no
recipient, and text before any header, the content. Markers are special tokens: the output is
decoded with them kept. Read from the decoded text (server/tools/harmony_text.py), as events by
server/tools/harmony_parser.py; the constraint is :func:`harmony_tag`'s."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.tools.base import DecodedCall, Schemas, ToolCallFormat
from server.tools.constraint import MAX_WHITESPACE
from server.tools.harmony_parser import HarmonyToolParser
from server.tools.harmony_text import (  # noqa: F401  (read_messages, split_output: re-exported)
    _MARKERS,
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    MESSAGE,
    NEXT,
    RETURN,
    START,
    HarmonyMessage,
    call_of,
    read_messages,
    split_output,
)


@dataclass(frozen=True)
class HarmonyFormat(ToolCallFormat):
    def render_call(self, name: str, arguments: Any) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                       ensure_ascii=False)
        return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}{args}{CALL}"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return NEXT.join(self.render_call(name, args) for name, args in calls)

    def how_to_call(self) -> str:
        return "To call a function, reply with a message to it:\n{example}"

    def decode_calls(self, block: str, schemas: Schemas | None = None
                     ) -> tuple[DecodedCall, ...] | None:
        calls = [call_of(m) for m in read_messages(block)]
        return tuple(c for c in calls if c is not None) or None

    @property
    def parser_class(self) -> type:
        return HarmonyToolParser

    def structural_tag(self, tools: Any) -> Any:
        return harmony_tag(tools)


def harmony_tag(tools: Any) -> Any:
    """The structural tag for a ``ToolSet``: an optional analysis message, then for ``auto`` a
    final message or calls, for ``required`` calls, for a named function that function's call;
    each call is ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`` with
    the arguments held to the tool's schema, then ``<|call|>`` or the end of the output
    (gpt-oss's ``<|call|>`` and ``<|return|>`` are stop tokens, which a constraint allows only
    where the output may end, so a message may end there; the text never holds them then); free
    text (the analysis, a final answer) holds no harmony marker. (xgrammar's own ``harmony`` tag
    lets ``required`` end with no call when the analysis channel is allowed, and forbids the
    analysis otherwise.)"""
    from xgrammar import structural_tag as st

    chosen = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
    calls = [st.TagFormat(
        begin=f"{CHANNEL}commentary to={FUNCTIONS}{t.name} {CONSTRAIN}json{MESSAGE}",
        content=st.JSONSchemaFormat(json_schema=t.parameters, max_whitespace_cnt=MAX_WHITESPACE),
        end=[CALL, ""]) for t in chosen]
    some_calls = st.TagsWithSeparatorFormat(
        tags=calls, separator=NEXT, at_least_one=True,
        stop_after_first=tools.choice == "named" or not tools.parallel)
    analysis = st.SequenceFormat(elements=[
        st.TagFormat(begin=f"{CHANNEL}analysis{MESSAGE}",
                     content=st.AnyTextFormat(excludes=list(_MARKERS)), end=END),
        st.ConstStringFormat(value=NEXT)])
    answer: Any = some_calls
    if tools.choice == "auto":
        final = st.TagFormat(begin=f"{CHANNEL}final{MESSAGE}",
                             content=st.AnyTextFormat(excludes=list(_MARKERS)),
                             end=[RETURN, END, ""])
        answer = st.OrFormat(elements=[final, some_calls])
    return st.StructuralTag(format=st.SequenceFormat(elements=[
        st.OptionalFormat(content=analysis), answer]))


HARMONY = HarmonyFormat("openai", None, markers=(CHANNEL, START, " to="), prefixes=(),
                        end_marker=None, arguments_key="arguments", special_marker=True)
