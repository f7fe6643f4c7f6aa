"""End to end: the qwen3_coder and deepseek_v31 formats through a real ``kvserve serve`` on a
loopback port, each with a tiny random model whose tokenizer carries the real chat template
(Qwen3-Coder's, which lists the tools itself; DeepSeek-V3.1's, which does not: kvserve's
default prompt does). The format is chosen from the template (logged at start); with
``tool_choice`` required or named the random model's constrained output comes back through the
OpenAI SDK as calls valid for the tools' schemas, plain and streamed alike (at temperature 0);
a tool-result turn renders and is served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine.loading.tiny import byte_tokenizer, make_tiny_model_dir
from loadgen.serve import free_port
from tests.server.tools.test_tool_formats_deepseek import DEEPSEEK_V31_TEMPLATE
from tests.server.tools.test_tool_formats_qwen3_coder import QWEN3_CODER_TEMPLATE

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "number", "minimum": -100, "maximum": 100},
        "exact": {"type": "boolean"}}, "required": ["a", "b", "exact"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Server:
    def __init__(self, url: str, log_path: Path) -> None:
        self.url, self.log_path = url, log_path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0,
                             timeout=300)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _serve(tmp: Path, model_type: str, template: str, *flags: str):
    model = make_tiny_model_dir(tmp / "model", model_type, max_position_embeddings=4096)
    tok = byte_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(model)
    port = free_port()
    log_path = tmp / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port",
             str(port), "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
             "--max-model-len", "4096", "--kv-cache-memory", "16MiB", "--seed", "0", *flags],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become healthy:\n{server.log()[-4000:]}")
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module", params=["qwen3_coder", "deepseek_v31"])
def server(request, tmp_path_factory):
    # DeepSeek-V3.1's template writes <think>: a reasoning parser would be chosen, and a random
    # model may think until max_tokens; these tests are about the calls, so it is off.
    model_type, template, *flags = {
        "qwen3_coder": ("qwen3", QWEN3_CODER_TEMPLATE),
        "deepseek_v31": ("llama", DEEPSEEK_V31_TEMPLATE, "--reasoning-parser", "none"),
    }[request.param]
    tmp = tmp_path_factory.mktemp(f"tools-{request.param}")
    for srv in _serve(tmp, model_type, template, *flags):
        srv.format = request.param
        yield srv


def _create(client, **kw):
    args = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=300,
                parallel_tool_calls=False)
    args.update(kw)
    return client.chat.completions.create(**args)


def _valid(calls, names=tuple(SCHEMAS)):
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_format_is_chosen_from_the_template_and_logged(server):
    assert f"tool calls: the {server.format} format" in server.log()


@pytest.mark.parametrize("choice,names", [
    ("required", tuple(SCHEMAS)),
    ({"type": "function", "function": {"name": "add"}}, ("add",))])
def test_calls_validate_plain_and_streamed_alike(server, choice, names):
    client = server.client()
    r = _create(client, tool_choice=choice)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    whole = [(c.function.name, c.function.arguments) for c in choice0.message.tool_calls]
    assert len(whole) == 1 and all(c.id.startswith("call_") for c in
                                   choice0.message.tool_calls)
    _valid(whole, names)
    assert choice0.message.content is None
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in _create(client, tool_choice=choice, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.function.name:
                assert call["name"] is None and part.id.startswith("call_")
                call["name"] = part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == whole


def test_a_tool_result_turn_is_served(server):
    client = server.client()
    call = _create(client, tool_choice="required").choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = _create(client, messages=history, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    _valid([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls])
    r = _create(client, messages=history, tool_choice="none", max_tokens=10)
    assert isinstance(r.choices[0].message.content, str)
