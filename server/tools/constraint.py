"""The constraint on a request's tool calls: xgrammar's structural tag for the format
(``xgrammar.get_model_structural_tag``: ``qwen_3`` for hermes, ``llama``, ``qwen_3_coder``,
``deepseek_r1`` for deepseek_v3, ``deepseek_v3_1`` for deepseek_v31; ``mistral_tag`` for
mistral, which xgrammar has no tag for; a format's own ``structural_tag``, harmony's, first),
as a ``StructuredSpec`` the engine compiles and caches like any other constraint.

``auto``: free text until the format's trigger, then the call with its arguments held to the
tool's ``parameters`` schema, then free text again; ``required``: as auto, at least one call
before the output may end, and no text first; a named function: exactly one call of it, no text
first; ``parallel_tool_calls: false``: the output ends after the first call; ``none``: no
constraint. Mistral's array form ends the output when it is required, named or the only call
allowed; its v11 form is per call, like hermes' blocks. Inside the arguments at most
``MAX_WHITESPACE`` whitespace characters come in a row. The reasoning block of thinking models
is not constrained (``reasoning="disabled"``) and their think tags may appear in free text."""

from __future__ import annotations

from typing import Any

from engine.params.structured import StructuredSpec
from server.tools.base import ToolCallFormat
from server.tools.mistral import MistralFormat
from server.tools.request import ToolSet

# At most this many whitespace characters in a row inside the arguments: the call's JSON stays
# short, and a small model cannot loop on newlines until max_tokens (as structured outputs
# keep JSON compact).
MAX_WHITESPACE = 1


def tool_call_spec(fmt: ToolCallFormat, tools: ToolSet) -> StructuredSpec | None:
    """The constraint for ``tools`` in format ``fmt``; None for ``tool_choice: none``.
    ValueError (a 400) if xgrammar refuses the tools."""
    if not tools.calls_expected:
        return None
    own = fmt.structural_tag(tools)
    if own is not None:
        return StructuredSpec.structural_tag(own)
    if isinstance(fmt, MistralFormat):
        return StructuredSpec.structural_tag(mistral_tag(fmt, tools))
    import xgrammar as xgr

    if tools.choice == "named":
        choice: object = {"type": "function", "function": {"name": tools.named}}
    else:
        choice = tools.choice
    tag = xgr.get_model_structural_tag(fmt.xgrammar_key, tools=tools.openai_tools(),
                                       tool_choice=choice, reasoning="disabled",
                                       exclude_special_tokens=False,
                                       max_whitespace_cnt=MAX_WHITESPACE,
                                       parallel_tool_calls=tools.parallel)
    return StructuredSpec.structural_tag(tag)


def mistral_tag(fmt: MistralFormat, tools: ToolSet) -> Any:
    """The structural tag for mistral calls (see the module's docstring)."""
    from xgrammar import structural_tag as st

    marker = fmt.markers[0]
    chosen = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
    one = tools.choice == "named" or not tools.parallel

    def arguments(tool: Any) -> Any:
        return st.JSONSchemaFormat(json_schema=tool.parameters,
                                   max_whitespace_cnt=MAX_WHITESPACE)

    if fmt.v11:
        calls = [st.TagFormat(begin=f"{marker}{t.name}{fmt.ARGS}", content=arguments(t), end="")
                 for t in chosen]
        if tools.choice == "named":
            return st.StructuralTag(format=calls[0])
        return st.StructuralTag(format=st.TriggeredTagsFormat(
            triggers=[marker], tags=calls, at_least_one=tools.choice == "required",
            stop_after_first=one))

    objects = [st.TagFormat(begin=f'{{"name": "{t.name}", "arguments": ', content=arguments(t),
                            end="}") for t in chosen]
    array = st.TagFormat(begin=marker, content=st.SequenceFormat(elements=[
        st.OptionalFormat(content=st.ConstStringFormat(value=" ")),
        st.ConstStringFormat(value="["),
        st.TagsWithSeparatorFormat(tags=objects, separator=", ", at_least_one=True,
                                   stop_after_first=one)]), end="]")
    if tools.choice in ("named", "required"):
        return st.StructuralTag(format=array)
    return st.StructuralTag(format=st.TriggeredTagsFormat(
        triggers=[marker], tags=[array], stop_after_first=one))
