"""server.tools.prompt: kvserve's default tool prompt for a template without tools (the
preamble merged into the system message, past calls as <tool_call> blocks, results as a user
turn of <tool_response> blocks), and a tools-aware template rendering the HF way (tools=,
arguments as a dict, tool messages with their call's name)."""

from __future__ import annotations

import json

from engine.chat_template import render_chat
from engine.loading.tiny import byte_tokenizer
from server.tools.formats import HERMES, LLAMA3_JSON
from server.tools.prompt import renders_tools, template_source, tool_conversation

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
HISTORY = [
    {"role": "user", "content": "add 1"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "1", "tool_call_id": "call_1"},
    {"role": "tool", "content": "again 1", "tool_call_id": "call_1"},
]
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.a }}]"
    "{% endfor %}{% if m.role == 'tool' %}({{ m.name }}){% endif %}\n{% endfor %}")


def test_default_prompt_for_a_template_without_tools():
    msgs, kwargs = tool_conversation(HISTORY, TOOLS, HERMES, native=False)
    assert kwargs == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in msgs[0]["content"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n' \
           "</tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert msgs[3]["content"] == ("<tool_response>\n1\n</tool_response>\n"
                                  "<tool_response>\nagain 1\n</tool_response>")
    tok = byte_tokenizer()
    assert not renders_tools(template_source(tok))
    text, _ = render_chat(tok, msgs)
    assert "<tools>" in text and "<tool_response>" in text


def test_the_preamble_joins_an_existing_system_message_and_follows_the_format():
    msgs, _ = tool_conversation([{"role": "system", "content": "Be brief."}, HISTORY[0]],
                                TOOLS, LLAMA3_JSON, native=False)
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '{"name": <function-name>, "parameters": <arguments-object>}' in msgs[0]["content"]
    plain, _ = tool_conversation(HISTORY[:1], None, HERMES, native=False)
    assert plain == HISTORY[:1]


def test_a_template_with_tools_renders_them_itself():
    tok = byte_tokenizer()
    tok.chat_template = NATIVE_TEMPLATE
    assert renders_tools(template_source(tok))
    msgs, kwargs = tool_conversation(HISTORY, TOOLS, HERMES, native=True)
    assert kwargs == {"tools": TOOLS}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[2]["name"] == "add"
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated
    text, _ = render_chat(tok, msgs, add_generation_prompt=False, template_kwargs=kwargs)
    assert text.startswith("TOOLS:[") and "assistant:[add 1]" in text and "tool:1(add)" in text
