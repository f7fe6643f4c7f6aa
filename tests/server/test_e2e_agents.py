"""End to end: agent frameworks drive tool loops against the real server (embedded
SmolLM2-135M) unmodified: the OpenAI Agents SDK (its default Responses model, with and without
server-side ``previous_response_id`` chaining, and its chat-completions model streamed) and
langchain-openai's ``bind_tools`` (chat completions and its Responses API mode). Each run calls
the tool with arguments that validate, feeds the result back, and ends on a text answer.

The first turn forces the tool (``tool_choice`` required or named): a 135M model rarely
chooses a tool by itself. The Agents SDK then resets ``tool_choice`` (its default), so the
answer turn is ``auto``; langchain's answer turn binds the tools without a choice."""

from __future__ import annotations

import asyncio

import agents
import langchain_openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from openai import AsyncOpenAI

pytestmark = pytest.mark.slow
MODEL = "smol-e2e"
QUESTION = "What is the weather in Paris?"
REPORT = "It is sunny and 21 degrees in {city}."


def _agents_run(real_server, *, responses: bool, stream: bool, chain: bool = False):
    agents.set_tracing_disabled(True)  # no trace export to OpenAI
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return REPORT.format(city=city)

    client = AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key=real_server.headers[
        "Authorization"].split()[1], max_retries=0, timeout=300)
    model = (agents.OpenAIResponsesModel if responses else
             agents.OpenAIChatCompletionsModel)(MODEL, client)
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the "
                         "get_weather tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required",
                                                             temperature=0, max_tokens=48))

    async def run():
        if stream:
            result = agents.Runner.run_streamed(agent, QUESTION, max_turns=4)
            kinds = [ev.type async for ev in result.stream_events()]
            assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
            return result
        return await agents.Runner.run(agent, QUESTION, max_turns=4,
                                       auto_previous_response_id=chain)

    result = asyncio.run(run())
    assert len(cities) == 1 and isinstance(cities[0], str) and cities[0]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == \
        "MessageOutputItem"
    assert isinstance(result.final_output, str)
    return result


def test_openai_agents_sdk_tool_loop_on_the_responses_api(real_server):
    result = _agents_run(real_server, responses=True, stream=False)
    assert len(result.raw_responses) == 2


def test_openai_agents_sdk_chains_turns_by_previous_response_id(real_server):
    result = _agents_run(real_server, responses=True, stream=False, chain=True)
    first, second = result.raw_responses
    assert second.response_id != first.response_id
    # The answer turn sent only the tool's output: the server continued the stored
    # conversation, which the prefix cache still holds.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_openai_agents_sdk_streamed_on_chat_completions(real_server):
    _agents_run(real_server, responses=False, stream=True)


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_bind_tools_loop(real_server, responses_api):
    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return REPORT.format(city=city)

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{real_server.url}/v1",
                               api_key=real_server.headers["Authorization"].split()[1],
                               temperature=0, max_tokens=48, max_retries=0, timeout=300,
                               use_responses_api=responses_api)
    history = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    assert isinstance(ai.tool_calls[0]["args"]["city"], str)
    history += [ai, get_weather.invoke(ai.tool_calls[0])]  # the ToolMessage answering it
    assert REPORT.format(city=ai.tool_calls[0]["args"]["city"]) in history[-1].content
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert isinstance(answer.text, str) and not answer.tool_calls
