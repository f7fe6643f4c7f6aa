"""Agent loops with a thinking model and a tool, through the real server: a tiny random model
whose chat template opens a thought (DeepSeek-R1's way), the server's ``--reasoning-budget``
bounding each thought. The OpenAI Agents SDK (its chat-completions model: a random model's
answer turn ends at max_tokens, which its Responses model treats as a failure) reads
``reasoning_content`` as a reasoning item before the call and ends on text; langchain-openai's
``bind_tools`` gets the call parsed from after the thought, with the thought apart. (The
Responses API's reasoning items, out and back in: test_reasoning_fake.py and
test_reasoning_qwen3_template.py.)"""

from __future__ import annotations

import asyncio
import json

import agents
import langchain_openai
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage

from tests.server.reasoning.test_reasoning_constrained import thinking_server

BUDGET = 5
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with thinking_server(tmp_path_factory.mktemp("agents"), positions=4096, kv="8MiB",
                         reasoning_budget=BUDGET) as server:
        yield server


def test_agents_sdk_loop_keeps_the_thought_apart(srv):
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    async def weather(ctx, args: str) -> str:
        cities.append(json.loads(args)["city"])
        return "sunny"

    tool = agents.FunctionTool(name="weather", description="The weather in a city.",
                               params_json_schema=CITY, on_invoke_tool=weather)
    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0,
                                timeout=120)
    agent = agents.Agent(name="w", instructions="Use the tool.", tools=[tool],
                         model=agents.OpenAIChatCompletionsModel("tiny", client),
                         model_settings=agents.ModelSettings(
                             tool_choice="required", temperature=0, max_tokens=120,
                             parallel_tool_calls=False))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:3] == ["ReasoningItem", "ToolCallItem", "ToolCallOutputItem"], kinds
    assert kinds[-1] == "MessageOutputItem" and len(cities) == 1
    first = result.raw_responses[0]
    assert first.usage.output_tokens_details.reasoning_tokens == BUDGET + len("</think>")
    assert result.new_items[0].raw_item.content or result.new_items[0].raw_item.summary
    assert isinstance(result.final_output, str)


def test_langchain_tool_call_after_the_thought(srv):
    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=f"{srv.url}/v1", api_key="-",
                                      temperature=0, max_tokens=120, max_retries=0)
    spec = {"type": "function", "function": {"name": "weather",
                                             "description": "The weather in a city.",
                                             "parameters": CITY}}
    ask = [HumanMessage("Weather in Rome?")]
    first = llm.bind_tools([spec], tool_choice="required", parallel_tool_calls=False).invoke(ask)
    [call] = first.tool_calls
    assert call["name"] == "weather" and call["args"]["city"] in ("Paris", "Rome")
    assert "<think>" not in (first.content or "") and "</think>" not in (first.content or "")
    answer = llm.bind_tools([spec]).invoke(
        ask + [first, ToolMessage("sunny", tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and "</think>" not in answer.content
