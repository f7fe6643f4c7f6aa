"""The constraint on a request's tool calls: xgrammar's structural tag for the format
(``xgrammar.get_model_structural_tag``), as a ``StructuredSpec`` the engine compiles and caches
like any other constraint.

* ``auto``: free text until the format's trigger (``<tool_call>``, ``{"name": ``), then the
  call, its arguments constrained to the tool's ``parameters`` schema; then free text again;
* ``required``: as auto, with at least one call before the output may end;
* a named function: exactly one call of that function;
* ``parallel_tool_calls: false``: the output ends after the first call;
* ``none``: no constraint.

Inside the arguments at most ``MAX_WHITESPACE`` whitespace characters come in a row.

The reasoning block of thinking models is not constrained (``reasoning="disabled"``) and their
think tags may appear in the free text.
"""

from __future__ import annotations

from engine.structured.spec import StructuredSpec
from server.tools.formats import ToolCallFormat
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
