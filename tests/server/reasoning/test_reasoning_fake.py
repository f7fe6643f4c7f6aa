"""Reasoning output through the real server and AsyncEngine over a fake core whose output is
known exactly (one character a token): the OpenAI SDK reads ``reasoning_content`` apart from
``content`` whole and streamed (deltas never carry a marker), ``include_reasoning: false`` drops
it, ``usage.completion_tokens_details.reasoning_tokens`` counts the thought, a template that
opens the thought in the prompt (DeepSeek-R1's) is followed, a tool call after a thought is
parsed from the answer, and ``--default-chat-template-kwargs`` reaches the template."""

from __future__ import annotations

import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.fakes import FakeCore, FakeTokenizer
from tests.server.helpers import ServerThread

THOUGHT = "<think>The user asks for France's capital.</think>\n\nParis."
MSG = [{"role": "user", "content": "What is the capital of France?"}]


class _OpensThought(FakeTokenizer):
    """A template that ends the prompt with an open thought unless told not to think."""

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True,
                            **kwargs) -> str:
        text = super().apply_chat_template(conversation, tokenize, add_generation_prompt)
        return text + ("<think>\n" if kwargs.get("enable_thinking", True) else "")


def _server(script: str, tokenizer=None, **settings):
    core = FakeCore(max_model_len=4096)
    core.script = script
    if tokenizer is not None:
        core.tokenizer = tokenizer
    engine = AsyncEngine(core=core)
    settings.setdefault("reasoning_parser", "qwen3")
    srv = ServerThread(build_app(engine, ServerSettings(**settings)))
    srv.client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    return srv


@pytest.fixture(scope="module")
def thinker():
    with _server(THOUGHT) as srv:
        yield srv


def _ask(srv, **kw):
    return srv.client.chat.completions.create(model="fake-model", messages=MSG,
                                              max_tokens=len(THOUGHT), **kw)


def test_the_thought_is_apart_from_the_answer(thinker):
    m = _ask(thinker).choices[0].message
    assert m.content == "Paris."
    assert m.reasoning_content == "The user asks for France's capital."
    assert m.model_extra["reasoning"] == m.reasoning_content
    usage = _ask(thinker).usage
    assert usage.completion_tokens_details.reasoning_tokens == THOUGHT.index("\n\nParis")


def test_streamed_deltas_split_alike_and_carry_no_marker(thinker):
    reasoning, content = [], []
    for chunk in _ask(thinker, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage.completion_tokens_details.reasoning_tokens > 0
            continue
        d = chunk.choices[0].delta
        extra = d.model_extra or {}
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(d.content or "")
    assert "".join(reasoning) == "The user asks for France's capital."
    assert "".join(content) == "Paris."
    assert not any("<" in piece for piece in reasoning + content)


def test_include_reasoning_false_drops_it(thinker):
    m = _ask(thinker, extra_body={"include_reasoning": False}).choices[0].message
    assert m.content == "Paris." and "reasoning_content" not in (m.model_extra or {})


def test_a_prompt_that_opens_the_thought_is_followed():
    script = "Thinking it over.</think>Paris."
    with _server(script, _OpensThought()) as srv:
        m = srv.client.chat.completions.create(model="fake-model", messages=MSG,
                                               max_tokens=len(script)).choices[0].message
        assert (m.reasoning_content, m.content) == ("Thinking it over.", "Paris.")
    with _server(script, _OpensThought(),
                 default_chat_template_kwargs={"enable_thinking": False}) as srv:
        m = srv.client.chat.completions.create(model="fake-model", messages=MSG,
                                               max_tokens=len(script)).choices[0].message
        assert m.content == script and "reasoning_content" not in (m.model_extra or {})


def test_a_tool_call_after_the_thought_is_parsed():
    script = ('<think>I need the weather tool.</think>\n<tool_call>\n{"name": "weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with _server(script) as srv:
        r = srv.client.chat.completions.create(model="fake-model", messages=MSG, tools=tools,
                                               max_tokens=len(script))
        m = r.choices[0].message
        assert m.reasoning_content == "I need the weather tool."
        assert m.tool_calls[0].function.name == "weather"
        assert m.tool_calls[0].function.arguments == '{"city": "Paris"}'
        calls, reasoning = [], []
        for chunk in srv.client.chat.completions.create(
                model="fake-model", messages=MSG, tools=tools, max_tokens=len(script),
                stream=True):
            d = chunk.choices[0].delta
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            calls += d.tool_calls or []
        assert "".join(reasoning) == "I need the weather tool."
        assert calls[0].function.name == "weather"


def test_the_responses_api_gives_a_reasoning_item_first(thinker):
    r = thinker.client.responses.create(model="fake-model", input="Capital of France?",
                                        max_output_tokens=len(THOUGHT))
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user asks for France's capital."
    assert r.output_text == "Paris."
    assert r.usage.output_tokens_details.reasoning_tokens == THOUGHT.index("\n\nParis")
    events = list(thinker.client.responses.create(model="fake-model", input="Capital?",
                                                  max_output_tokens=len(THOUGHT), stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "The user asks for France's capital."
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning", "message"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    # the stored response continues: its reasoning item is left out of the next prompt
    again = thinker.client.responses.create(model="fake-model", input="And Italy?",
                                            previous_response_id=final.id,
                                            max_output_tokens=len(THOUGHT))
    assert again.output_text == "Paris."


def test_harmony_analysis_channel_is_the_reasoning():
    # gpt-oss: the analysis channel is the thought, the final channel the answer, with or
    # without tools (server/tools/harmony_parser.py), whole and streamed
    script = ("<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant"
              "<|channel|>final<|message|>Paris.<|return|>")
    with _server(script, tool_call_parser="openai", reasoning_parser="none") as srv:
        m = srv.client.chat.completions.create(model="fake-model", messages=MSG,
                                               max_tokens=len(script)).choices[0].message
        assert (m.reasoning_content, m.content) == ("Think it over.", "Paris.")
        reasoning, content = [], []
        for chunk in srv.client.chat.completions.create(
                model="fake-model", messages=MSG, max_tokens=len(script), stream=True):
            d = chunk.choices[0].delta
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            content.append(d.content or "")
        assert ("".join(reasoning), "".join(content)) == ("Think it over.", "Paris.")
        r = srv.client.responses.create(model="fake-model", input="Capital?",
                                        max_output_tokens=len(script))
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert (r.output[0].content[0].text, r.output_text) == ("Think it over.", "Paris.")
        events = list(srv.client.responses.create(model="fake-model", input="Capital?",
                                                  max_output_tokens=len(script), stream=True))
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == "Think it over."

