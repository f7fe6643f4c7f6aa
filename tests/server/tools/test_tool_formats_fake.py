"""The new tool-call formats through the real server over a fake core whose output is known
exactly (one character a token): for qwen3_coder, deepseek_v3, deepseek_v31, openai
(harmony), granite and phi4_mini_json, the OpenAI SDK reads the calls whole and streamed (name first, then the arguments,
which concatenate to the whole call's), the content before them, typed qwen3_coder values; a
constraint is sent for each request with tools."""

from __future__ import annotations

import json

import openai
import pytest

from engine.async_engine import AsyncEngine
from server.app import build_app
from server.config_file import ServerSettings
from tests.server import fakes
from tests.server.fakes import FakeCore
from tests.server.helpers import ServerThread

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                     "note": {"type": "string"}}}}}]
B, E, CB, CE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
ARGS = {"a": 1, "b": 2.5, "note": "x y"}
SCRIPTS = {
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "<parameter=b>\n2.5\n</parameter>\n<parameter=note>\nx y\n</parameter>\n"
                    "</function>\n</tool_call>", "Sure."),
    "deepseek_v3": (f"Sure.{B}{CB}function{SEP}add\n```json\n{json.dumps(ARGS)}\n```{CE}{E}",
                    "Sure."),
    "deepseek_v31": (f"Sure.{B}{CB}add{SEP}{json.dumps(ARGS)}{CE}{E}", "Sure."),
    "openai": ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>"
               "commentary to=functions.add <|constrain|>json<|message|>"
               f"{json.dumps(ARGS)}<|call|>", None),
    "granite": (f'Sure.<|tool_call|>[{{"name": "add", "arguments": {json.dumps(ARGS)}}}]',
                "Sure."),
    "phi4_mini_json": (f'Sure. functools[{{"name": "add", "arguments": {json.dumps(ARGS)}}}]',
                       "Sure."),
}


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
def test_calls_whole_and_streamed(parser, monkeypatch):
    script, content = SCRIPTS[parser]
    monkeypatch.setattr(fakes, "VOCAB", 0x10000)  # DeepSeek's markers: full-width characters
    core = FakeCore(max_model_len=4096)
    core.script = script + "#"
    app = build_app(AsyncEngine(core=core), ServerSettings(tool_call_parser=parser))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        args = dict(model="fake-model", messages=[{"role": "user", "content": "add"}],
                    tools=TOOLS, stop=["#"], max_tokens=len(script) + 5)
        r = client.chat.completions.create(**args)
        assert core.structured.specs[-1].kind == "structural_tag"
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == ARGS
        chunks = list(client.chat.completions.create(**args, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == (content or "")
        parts = [p for c in chunks for p in c.choices[0].delta.tool_calls or ()]
        assert parts[0].function.name == "add" and parts[0].id.startswith("call_")
        assert all(p.index == 0 and p.function.name in (None, "add") for p in parts)
        assert json.loads("".join(p.function.arguments or "" for p in parts)) == ARGS
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
