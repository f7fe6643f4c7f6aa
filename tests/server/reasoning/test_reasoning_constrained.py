"""Constraints after the thought, through the real server and a tiny random model whose chat
template opens a thought (DeepSeek-R1's way) or closes it (Qwen3's ``enable_thinking: false``):
the thought is free and holds exactly ``thinking_token_budget`` tokens (the closing marker is
then forced), the answer after it follows the ``json_schema`` or the forced tool call; a
closed thought leaves the constraint to apply from the first token. Read with the ``openai``
SDK, whole and streamed. The byte tokenizer writes one token per byte."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.helpers import ServerThread

# DeepSeek-R1's shape: the prompt ends inside an open thought, unless thinking is off (then an
# empty, closed one: Qwen3's enable_thinking=false).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "mood": {"enum": ["calm", "busy"]}},
          "required": ["ok", "mood"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "Is it fine?"}]


@contextlib.contextmanager
def thinking_server(directory, positions: int = 2048, kv: str = "4MiB", **settings):
    """A real server over a tiny random Llama whose chat template is TEMPLATE."""
    path = make_tiny_model_dir(directory / "tiny", "llama", max_position_embeddings=positions)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    engine = AsyncEngine(EngineConfig(model=str(path), served_model_name="tiny", dtype="float32",
                                      device="cpu", kv_cache_memory=kv, max_num_seqs=8))
    with ServerThread(build_app(engine, ServerSettings(**settings))) as server:
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        yield server


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with thinking_server(tmp_path_factory.mktemp("think")) as server:
        yield server


def _ask(srv, budget, **kw):
    return srv.client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=80, temperature=0,
        extra_body={"thinking_token_budget": budget, **kw.pop("extra_body", {})}, **kw)


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_free_thought_of_the_budget_then_a_schema_valid_answer(srv, budget):
    r = _ask(srv, budget, response_format=FORMAT)
    m = r.choices[0].message
    assert len(m.reasoning_content) <= budget  # a byte a token (some bytes join in UTF-8)
    jsonschema.validate(json.loads(m.content), SCHEMA)
    # the thought and its closing marker (8 byte tokens)
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + len("</think>")
    assert r.choices[0].finish_reason == "stop"


def test_streamed_alike(srv):
    whole = _ask(srv, 5, response_format=FORMAT).choices[0].message
    reasoning, content = [], []
    for chunk in _ask(srv, 5, response_format=FORMAT, stream=True):
        d = chunk.choices[0].delta
        reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
        content.append(d.content or "")
    assert ("".join(reasoning), "".join(content)) == (whole.reasoning_content, whole.content)


def test_a_budget_alone_bounds_the_thought(srv):
    r = _ask(srv, 4)
    assert r.usage.completion_tokens_details.reasoning_tokens == 4 + len("</think>")
    assert r.choices[0].message.content is not None


def test_a_closed_thought_is_constrained_from_the_first_token(srv):
    r = _ask(srv, 5, response_format=FORMAT,
             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    jsonschema.validate(json.loads(m.content), SCHEMA)
    assert "reasoning_content" not in (m.model_extra or {})


def test_a_forced_tool_call_follows_the_thought(srv):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}]
    r = srv.client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=120, temperature=0, tools=tools,
        tool_choice="required", parallel_tool_calls=False,
        extra_body={"thinking_token_budget": 6})
    m = r.choices[0].message
    assert r.usage.completion_tokens_details.reasoning_tokens == 6 + len("</think>")
    assert m.tool_calls[0].function.name == "weather"
    assert json.loads(m.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    assert r.choices[0].finish_reason == "tool_calls", r


def test_a_negative_budget_is_a_400(srv):
    with pytest.raises(openai.BadRequestError):
        _ask(srv, -1)
