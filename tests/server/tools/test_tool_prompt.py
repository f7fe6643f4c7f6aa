"""server.tools.prompt: kvserve's default tool prompt for a template without tools (the
preamble merged into the system message, past calls as <tool_call> blocks, results as a user
turn of <tool_response> blocks), and a tools-aware template rendering the HF way (tools=,
arguments as a dict, tool messages with their call's name); mistral's default prompt (a
[TOOL_CALLS] array) and a Mistral-style template, which insists on 9-character call ids."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import render_chat
from engine.loading.tiny import byte_tokenizer
from server.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, choose_format
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


# After Mistral-7B-Instruct-v0.3's template: tools before the last user turn, past calls as a
# [TOOL_CALLS] array with 9-character ids, results as [TOOL_RESULTS] with the call's id.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}'
    "{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be "
    "alphanumeric strings with length 9!') }}{% endif %}"
    '[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}'
    "[/TOOL_RESULTS]{% endif %}{% endfor %}")


def test_mistral_default_prompt_writes_calls_as_one_array():
    two = {**HISTORY[1], "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {
        "name": "add", "arguments": '{"a": 2}'}}]}
    msgs, _ = tool_conversation([HISTORY[0], two], TOOLS, MISTRAL, native=False)
    assert ('[TOOL_CALLS] and a JSON array of the calls' in msgs[0]["content"]
            and '[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-object>}]'
            in msgs[0]["content"])
    assert msgs[2]["content"] == ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                                  '{"name": "add", "arguments": {"a": 2}}]')
    msgs, _ = tool_conversation([HISTORY[0], two], TOOLS, MISTRAL_V11, native=False)
    assert "[TOOL_CALLS]<function-name>[ARGS]<arguments-object>" in msgs[0]["content"]
    assert msgs[2]["content"] == '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}'


def test_a_mistral_template_renders_tools_with_mistral_call_ids():
    tok = byte_tokenizer()
    tok.chat_template = MISTRAL_TEMPLATE
    assert renders_tools(template_source(tok))
    assert choose_format(template_source(tok))[0] is MISTRAL
    history = HISTORY[:3] + [{"role": "user", "content": "and 2?"}]
    msgs, kwargs = tool_conversation(history, TOOLS, MISTRAL, native=True)
    text, _ = render_chat(tok, msgs, template_kwargs=kwargs)
    assert text == (
        '<s>[INST] add 1[/INST][TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, '
        '"id": "0000call1"}]</s>[TOOL_RESULTS] {"content": "1", "call_id": "0000call1"}'
        "[/TOOL_RESULTS][AVAILABLE_TOOLS] " + json.dumps(TOOLS) + "[/AVAILABLE_TOOLS]"
        "[INST] and 2?[/INST]")
    msgs, kwargs = tool_conversation(history, TOOLS, HERMES, native=True)  # ids as given
    with pytest.raises(ValueError, match="length 9"):
        render_chat(tok, msgs, template_kwargs=kwargs)
