"""A tiny random Qwen3 carrying Qwen3's published chat template (tests/server/reasoning/templates/
qwen3.jinja), through the real server: the qwen3 reasoning parser is chosen from the template
by itself; ``enable_thinking: false`` (per request or ``--default-chat-template-kwargs``)
closes the thought in the prompt, so a ``json_schema`` holds from the first token and no
thought or empty think block comes back; an assistant turn's ``reasoning_content`` given back
(chat, or a Responses ``reasoning`` item) reaches the template, which renders it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
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

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3") / "tiny", "qwen3",
                               max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def _serve(model_dir, **settings):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), served_model_name="tiny",
                                      dtype="float32", device="cpu", kv_cache_memory="4MiB",
                                      max_num_seqs=4))
    app = build_app(engine, ServerSettings(**settings))
    srv = ServerThread(app)
    srv.app = app
    return srv


@pytest.fixture(scope="module")
def srv(model_dir):
    with _serve(model_dir) as server:
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        yield server


def test_the_parser_is_chosen_from_the_template(srv):
    assert srv.app.state.ctx.reasoning.name == "qwen3"


def test_thinking_off_is_constrained_from_the_first_token(srv):
    r = srv.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=40,
        temperature=0, response_format=FORMAT, extra_body=OFF)
    m = r.choices[0].message
    jsonschema.validate(json.loads(m.content), SCHEMA)
    assert "<think>" not in m.content and "reasoning_content" not in (m.model_extra or {})


def test_thinking_on_the_answer_after_a_thought_or_none_follows_the_schema(srv):
    # the template does not open the thought: the model opens one (bounded by the budget) or
    # answers at once, and either way the answer holds to the schema
    for budget in (0, 4):
        r = srv.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=60,
            temperature=0, response_format=FORMAT,
            extra_body={"thinking_token_budget": budget})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_a_thought_given_back_reaches_the_template(srv):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "be kind"}]
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": msgs,
                                                "add_generation_prompt": False})
    text = AutoTokenizer.from_pretrained(srv.app.state.ctx.engine.config.model).decode(
        r.json()["tokens"])
    assert "<think>\nbe kind\n</think>\n\nhello" in text
    bad = httpx.post(f"{srv.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]})
    assert bad.status_code == 400


def test_a_responses_reasoning_item_becomes_the_turns_thought(srv):
    turn = [{"role": "user", "content": "hi"}]
    answer = {"role": "assistant", "content": "hello"}
    thought = {"type": "reasoning", "summary": [],
               "content": [{"type": "reasoning_text", "text": "think about it first"}]}
    without = srv.client.responses.create(model="tiny", input=turn + [answer],
                                          max_output_tokens=2)
    with_thought = srv.client.responses.create(model="tiny", input=turn + [thought, answer],
                                               max_output_tokens=2)
    grown = with_thought.usage.input_tokens - without.usage.input_tokens
    # the template writes the last assistant turn's think block either way: only its text grows
    assert grown == len("think about it first")


def test_thinking_off_by_default_for_every_request(model_dir):
    with _serve(model_dir, default_chat_template_kwargs={"enable_thinking": False}) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 40,
            "temperature": 0, "response_format": FORMAT}, timeout=60).json()
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), SCHEMA)
