"""deepseek_v3 / deepseek_v31 (server/tools/deepseek.py): DeepSeek's calls between
<｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, V3's ``function<｜tool▁sep｜>NAME\n```json``
form and V3.1's ``NAME<｜tool▁sep｜>{...}``, each read by either format, whole and streamed
(markers split across pieces), content before the calls, several calls, a block cut short;
the real DeepSeek-V3.1 chat template chooses deepseek_v31 and renders a tool loop (past
arguments as text; a template that writes them ``|tojson`` gets a dict); the constraints
(xgrammar's deepseek_r1 and deepseek_v3_1 tags) walked at random give calls valid for the
schemas."""

from __future__ import annotations

import json

import pytest

from engine.loading.tiny import byte_tokenizer
from server.tools.deepseek import DEEPSEEK_V3, DEEPSEEK_V31
from server.tools.formats import choose_format
from server.tools.parser import parse_tool_calls
from server.tools.prompt import renders_tools, tool_conversation
from tests.server.tools.test_tool_formats_common import (
    TOOLS,
    assert_stream_matches,
    check_walks,
    names,
    streamed,
)

# DeepSeek-V3.1's chat template (deepseek-ai/DeepSeek-V3.1, tokenizer_config.json), verbatim
# but for its line breaks: it has no tools of its own (kvserve's default prompt lists them).
DEEPSEEK_V31_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, "
    "is_last_user=false) %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + "
    "'\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}"
    "{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}"
    "{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and "
    "message['tool_calls'] is not none %}{%- if ns.is_last_user %}"
    "{{'<｜Assistant｜></think>'}}{%- endif %}{%- set ns.is_last_user = false -%}"
    "{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    "{%- if message['content'] is none %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ "
    "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
    "'<｜tool▁call▁end｜>'}}{%- else %}{{message['content'] + '<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
    "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{%- endif %}"
    "{%- set ns.is_first = true -%}{%- else %}{{'<｜tool▁call▁begin｜>'+ "
    "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
    "'<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or "
    "message['tool_calls'] is none) %}{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}"
    "{%- if message['prefix'] is defined and message['prefix'] and thinking %}{{'<think>'}}  "
    "{%- else %}{{'</think>'}}{%- endif %}{%- endif %}{%- set ns.is_last_user = false -%}"
    "{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}{%- set content = message['content'] -%}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>', 1)[1] -%}"
    "{%- endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}"
    "{%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endfor -%}{%- if add_generation_prompt and "
    "ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}{%- if not thinking %}"
    "{{'</think>'}}{%- else %}{{'<think>'}}{%- endif %}{% endif %}")

B, E, CB, CE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
V3 = (f"{B}{CB}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\", \"unit\": \"c\"}}\n```"
      f"{CE}\n{CB}function{SEP}add\n```json\n{{\"a\": 1, \"b\": 2, \"exact\": false}}\n```{CE}{E}")
V31 = (f"{B}{CB}get_weather{SEP}{{\"city\": \"Paris\", \"unit\": \"c\"}}{CE}"
       f"{CB}add{SEP}{{\"a\": 1, \"b\": 2, \"exact\": false}}{CE}{E}")
EXPECTED = [("get_weather", {"city": "Paris", "unit": "c"}),
            ("add", {"a": 1, "b": 2, "exact": False})]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt", [DEEPSEEK_V3, DEEPSEEK_V31])
@pytest.mark.parametrize("text", [V3, V31])
def test_either_form_whole_and_streamed_with_content_first(fmt, text):
    parsed = parse_tool_calls("Checking both.\n\n" + text, fmt, names())
    assert parsed.content == "Checking both."
    assert _calls(parsed) == EXPECTED
    assert_stream_matches("Checking both.\n\n" + text, fmt)
    content, calls, _ = streamed(text, fmt)  # one character at a time: no marker leaks
    assert content == "" and len(calls) == 2


def test_the_formats_write_their_own_form():
    assert DEEPSEEK_V3.render_calls(EXPECTED) == V3.replace('{"city": "Paris", "unit": "c"}',
                                                            '{"city": "Paris", "unit": "c"}')
    assert DEEPSEEK_V31.render_calls(EXPECTED) == V31


def test_a_block_cut_short_or_broken_is_text():
    for text in (V31[:V31.index(CE, 60) + 3], V31[:-len(E)] + CB + "add",
                 f"{B}{CB}get_weather{SEP}not json{CE}{E}"):
        parsed = parse_tool_calls("Hi " + text, DEEPSEEK_V31, names())
        assert parsed.calls == () and parsed.content == "Hi " + text, text
        assert_stream_matches("Hi " + text, DEEPSEEK_V31)
    # Complete calls with the closing marker missing (the output stopped there) count.
    assert _calls(parse_tool_calls(V31[:-len(E)], DEEPSEEK_V31, names())) == EXPECTED


def test_the_real_v31_template_chooses_the_format_and_renders_a_tool_loop():
    fmt, why = choose_format(DEEPSEEK_V31_TEMPLATE)
    assert fmt.name == "deepseek_v31" and fmt.arguments_text, why
    assert not renders_tools(DEEPSEEK_V31_TEMPLATE)  # kvserve's default prompt lists them
    tok = byte_tokenizer()
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    call = f'{B}{CB}get_weather{SEP}{{"city": "Paris", "unit": "c"}}{CE}{E}'
    for native in (True, False):  # the template's own rendering of calls, and kvserve's
        tok.chat_template = DEEPSEEK_V31_TEMPLATE
        messages, kwargs = tool_conversation(conv, TOOLS, fmt, native=native)
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **kwargs)
        assert call in text, text
    assert "<｜tool▁call▁begin｜>" in text.split("<｜User｜>")[0]  # the preamble's example
    # A template that writes the arguments |tojson (vLLM's example) gets them as a dict.
    tojson = ("{% for m in messages %}{% for t in m['tool_calls'] or [] %}"
              "{{ t['function']['name'] + '<｜tool▁sep｜>' + t['function']['arguments']|tojson }}"
              "{% endfor %}{% endfor %}<｜tool▁calls▁begin｜>")
    fmt, _ = choose_format(tojson)
    assert fmt.name == "deepseek_v31" and not fmt.arguments_text
    tok.chat_template = tojson
    messages, _ = tool_conversation(conv, TOOLS, fmt, native=True)
    assert tok.apply_chat_template(messages, tokenize=False).startswith(
        'get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "c"}')


@pytest.mark.parametrize("fmt", [DEEPSEEK_V3, DEEPSEEK_V31])
@pytest.mark.parametrize("choice,parallel,expect", [
    ("required", None, None), ("required", False, None), ("auto", None, None),
    ({"type": "function", "function": {"name": "get_weather"}}, None, "get_weather")])
def test_constrained_random_output_parses_into_valid_calls(tok, backend, fmt, choice, parallel,
                                                           expect):
    check_walks(tok, backend, fmt, choice, seeds=range(4), parallel=parallel, expect=expect)
