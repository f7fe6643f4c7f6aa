"""qwen3_coder (server/tools/qwen3_coder.py): Qwen3-Coder's XML calls, whole and streamed
(markers split across pieces), content before the calls, several calls, values typed by the
tool's schema as vLLM's qwen3_coder parser does, a block cut short; the real Qwen3-Coder chat
template chooses the format and renders a tool loop; the constraint (xgrammar's qwen_3_coder
tag) walked at random gives calls valid for the schemas."""

from __future__ import annotations

import json

import pytest

from engine.loading.tiny import byte_tokenizer
from server.tools.formats import choose_format
from server.tools.parser import parse_tool_calls
from server.tools.prompt import renders_tools, tool_conversation
from server.tools.qwen3_coder import QWEN3_CODER, convert_value
from tests.server.tools.test_tool_formats_common import (
    TOOLS,
    assert_stream_matches,
    check_walks,
    names,
    streamed,
)

# Qwen3-Coder's chat template (Qwen/Qwen3-Coder-480B-A35B-Instruct; vLLM ships it as
# examples/tool_chat_template_qwen3coder.jinja), verbatim.
QWEN3_CODER_TEMPLATE = r"""{% macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{-'\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{% endmacro %}

{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}

{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks." }}
    {%- endif %}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n" }}
    {{- "<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>' }}
                {{- '\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {%- if param_fields.description is defined %}
                    {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
                {%- endif %}
                {%- set handled_keys = ['name', 'type', 'description'] %}
                {{- render_extra_keys(param_fields, handled_keys) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {% set handled_keys = ['type', 'properties'] %}
        {{- render_extra_keys(tool.parameters, handled_keys) }}
        {{- '\n</parameters>' }}
        {%- set handled_keys = ['type', 'name', 'description', 'parameters'] %}
        {{- render_extra_keys(tool, handled_keys) }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
{%- endif %}
{%- if system_message is defined %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if tools is iterable and tools | length > 0 %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\n' }}
        {%- endif %}
        {{- '<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>")
ADD_CALL = ("<tool_call>\n<function=add>\n<parameter=a>\n-3\n</parameter>\n<parameter=b>\n"
            "40\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n"
            "[1, 2]\n</parameter>\n</function>\n</tool_call>")


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_content_then_two_calls_whole_and_streamed():
    text = f"Let me look that up.\n{CALL}\n{ADD_CALL}"
    parsed = parse_tool_calls(text, QWEN3_CODER, names())
    assert parsed.content == "Let me look that up."
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"}),
                              ("add", {"a": -3, "b": 40, "exact": True, "tags": [1, 2]})]
    assert_stream_matches(text, QWEN3_CODER)
    content, calls, _ = streamed(text, QWEN3_CODER)  # one character at a time
    assert content.rstrip() == "Let me look that up." and "<" not in content
    assert len(calls) == 2


def test_no_call_is_all_content_and_a_bare_function_block_counts():
    text = "The weather is <b>fine</b>; use <tool_call> blocks to call."
    assert parse_tool_calls(text, QWEN3_CODER, names()).calls == ()
    assert parse_tool_calls(text, QWEN3_CODER, names()).content == text
    assert_stream_matches(text, QWEN3_CODER)
    bare = "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>"
    assert _calls(parse_tool_calls(bare, QWEN3_CODER, names())) == [
        ("get_weather", {"city": "Rome"})]
    assert_stream_matches(bare, QWEN3_CODER)


def test_a_block_cut_short_is_text_unless_its_function_closed():
    cut = CALL[:CALL.index("</parameter>", 60)]
    parsed = parse_tool_calls("Hi " + cut, QWEN3_CODER, names())
    assert parsed.calls == () and parsed.content == "Hi " + cut
    no_end_tag = CALL[:-len("\n</tool_call>")]
    assert _calls(parse_tool_calls(no_end_tag, QWEN3_CODER, names())) == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    assert_stream_matches(no_end_tag, QWEN3_CODER)


def test_multi_line_values_keep_their_inner_whitespace():
    code = "def f():\n    return 1\n"
    tools = [{"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "text": {"type": "string"}}}}}]
    text = (f"<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n"
            f"<parameter=text>\n{code}\n</parameter>\n</function>\n</tool_call>")
    parsed = parse_tool_calls(text, QWEN3_CODER, names(tools=tools))
    assert _calls(parsed) == [("write", {"path": "a.py", "text": code})]


@pytest.mark.parametrize("raw,schema,expected", [
    ("42", {"type": "integer"}, 42),
    ("-7", {"type": "integer"}, -7),
    ("4.0", {"type": "integer"}, "4.0"),  # not an int: the text
    ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3),
    ("3.0", {"type": "number"}, 3),
    ("1e3", {"type": "number"}, 1000),
    ("TRUE", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ("007", {"type": "string"}, "007"),
    ("null", {"type": "string"}, "null"),
    ("null", {"type": ["string", "null"]}, None),
    ("null", {"type": "integer"}, None),
    ("12", {"type": ["integer", "null"]}, 12),
    ('{"x": [1, {"y": null}]}', {"type": "object"}, {"x": [1, {"y": None}]}),
    ("{'x': True}", {"type": "object"}, {"x": True}),  # a Python literal
    ("[1, 'a']", {"type": "array"}, [1, "a"]),
    ("not json", {"type": "array"}, "not json"),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
    ("f", {"enum": ["c", "f"]}, "f"),
    ("2", {"enum": [1, 2]}, 2),
    ("8", {"description": "untyped"}, "8"),
    ("8", None, "8"),  # a parameter the tool does not declare
])
def test_values_are_typed_by_the_schema(raw, schema, expected):
    value = convert_value(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_the_schema_types_a_streamed_call_too():
    _, calls, _ = streamed(ADD_CALL, QWEN3_CODER, [3])
    assert json.loads(calls[0].arguments) == {"a": -3, "b": 40, "exact": True, "tags": [1, 2]}
    # Without the schemas (a plain set of names) every value stays text.
    _, calls, _ = streamed(ADD_CALL, QWEN3_CODER, [3], tool_names={"add"})
    assert json.loads(calls[0].arguments)["a"] == "-3"


def test_the_real_template_chooses_the_format_and_renders_a_tool_loop():
    fmt, why = choose_format(QWEN3_CODER_TEMPLATE)
    assert fmt is QWEN3_CODER, why
    assert renders_tools(QWEN3_CODER_TEMPLATE)
    tok = byte_tokenizer()
    tok.chat_template = QWEN3_CODER_TEMPLATE
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    messages, kwargs = tool_conversation(conv, TOOLS, fmt, native=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   **kwargs)
    assert "<name>get_weather</name>" in text
    assert CALL in text  # the past call, as the model writes one
    assert text.endswith("<tool_response>\n18 C\n</tool_response>\n<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # What kvserve's default prompt shows a template without tools parses back.
    assert _calls(parse_tool_calls(fmt.render_calls([("get_weather", {"city": "Paris",
                                                                       "unit": "c"})]),
                                   fmt, names())) == [("get_weather", {"city": "Paris",
                                                                       "unit": "c"})]


@pytest.mark.parametrize("choice,parallel,expect", [
    ("required", None, None), ("required", False, None), ("auto", None, None),
    ({"type": "function", "function": {"name": "add"}}, None, "add")])
def test_constrained_random_output_parses_into_valid_calls(tok, backend, choice, parallel,
                                                           expect):
    check_walks(tok, backend, QWEN3_CODER, choice, parallel=parallel, expect=expect)
