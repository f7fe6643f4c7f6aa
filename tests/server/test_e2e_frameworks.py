"""End to end: structured-output frameworks, unmodified, against the real server (embedded
SmolLM2-135M). instructor (``Mode.JSON_SCHEMA``, ``Mode.JSON``, partial streaming) and
langchain-openai's ``with_structured_output`` (its default ``json_schema`` method,
``json_mode``) each return a validated pydantic instance, including a nested model with a list
of objects (``$defs``/``$ref``). Every request is recorded on its way out (an httpx event hook)
to check the form each library sends, so a pass is the constraint's doing, not the model's luck;
``max_retries=0`` everywhere, so no retry hides a failure. langchain's ``function_calling``
method sends the model as a forced tool call, answered through the tool-calling path."""

from __future__ import annotations

import json

import httpx
import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
MAX_TOKENS = 200  # every answer here is well under it: the bounds below keep them short
# The JSON modes constrain to "some JSON object"; the fields come from the prompt. langchain's
# docs say as much for json_mode; a 135M model needs an example to copy the shape from.
EXAMPLE = '{"name": "Berlin", "country": "Germany", "population": 3600000}'


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


class Trip(BaseModel):
    title: str = Field(max_length=40)
    days: int = Field(ge=1, le=30)
    cities: list[City] = Field(min_length=1, max_length=2)


class Recorder:
    """The JSON bodies of the requests an httpx client sends."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content or b"{}"))

    @property
    def last(self) -> dict:
        return self.bodies[-1]


@pytest.fixture
def sent():
    return Recorder()


@pytest.fixture
def http_client(sent):
    with httpx.Client(event_hooks={"request": [sent]}, timeout=300) as client:
        yield client


@pytest.fixture
def openai_client(real_server, http_client):
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=real_server.client().api_key,
                         max_retries=0, http_client=http_client)


@pytest.fixture(scope="module")
def model(real_server) -> str:
    return real_server.client().models.list().data[0].id  # the served name (smol-e2e)


@pytest.fixture
def chat(real_server, http_client, model):
    return ChatOpenAI(base_url=f"{real_server.url}/v1", api_key=real_server.client().api_key,
                      model=model, temperature=0, max_tokens=MAX_TOKENS, max_retries=0,
                      http_client=http_client)


def _schema_form(body: dict, name: str) -> dict:
    rf = body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == name
    return rf["json_schema"]


# ---- instructor ----------------------------------------------------------------------------

def test_instructor_json_schema_mode(openai_client, model, sent):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON_SCHEMA)
    city, completion = client.chat.completions.create_with_completion(
        model=model, response_model=City, max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(city, City) and city.name  # validated by pydantic, bounds included
    assert completion.choices[0].finish_reason == "stop"
    form = _schema_form(sent.last, "City")
    population = form["schema"]["properties"]["population"]
    assert (population["minimum"], population["maximum"]) == (0, 100_000_000)
    # the fields come in the model's order, as the schema lists them
    assert list(json.loads(completion.choices[0].message.content)) == list(City.model_fields)


def test_instructor_nested_model_with_a_list(openai_client, model, sent):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON_SCHEMA)
    trip = client.chat.completions.create(
        model=model, response_model=Trip, max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "Plan a short trip through two French cities, "
                                              "as JSON."}])
    assert isinstance(trip, Trip) and 1 <= len(trip.cities) <= 2
    assert all(isinstance(c, City) for c in trip.cities)
    schema = _schema_form(sent.last, "Trip")["schema"]
    assert schema["properties"]["cities"]["items"] == {"$ref": "#/$defs/City"}


def test_instructor_json_mode(openai_client, model, sent):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON)
    city = client.chat.completions.create(
        model=model, response_model=City, max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": f"Describe a city. Answer with JSON like "
                                              f"{EXAMPLE}"}])
    assert isinstance(city, City) and city.name
    assert sent.last["response_format"] == {"type": "json_object"}
    assert sent.last["messages"][0]["role"] == "system"  # instructor's schema prompt
    assert '"population"' in sent.last["messages"][0]["content"]


def test_instructor_streams_partial_objects(openai_client, model, sent):
    client = instructor.from_openai(openai_client, mode=instructor.Mode.JSON_SCHEMA)
    partials = list(client.chat.completions.create_partial(
        model=model, response_model=City, max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}]))
    assert sent.last["stream"] is True
    assert any(p.population is None for p in partials[:-1])  # it arrived in pieces
    City.model_validate(partials[-1].model_dump())  # the last one is whole and valid


# ---- langchain-openai ----------------------------------------------------------------------

def test_langchain_default_method_is_json_schema(chat, sent):
    out = chat.with_structured_output(City, include_raw=True).invoke("Describe Paris as JSON.")
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], City) and out["parsed"].name
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    form = _schema_form(sent.last, "City")
    assert form["strict"] is True and form["schema"]["additionalProperties"] is False
    assert sent.last["max_completion_tokens"] == MAX_TOKENS
    assert list(json.loads(out["raw"].content)) == list(City.model_fields)


def test_langchain_nested_model_with_a_list(chat, sent):
    trip = chat.with_structured_output(Trip).invoke(
        "Plan a short trip through two French cities, as JSON.")
    assert isinstance(trip, Trip) and 1 <= len(trip.cities) <= 2
    assert "$defs" in _schema_form(sent.last, "Trip")["schema"]


def test_langchain_json_mode(chat, sent):
    city = chat.with_structured_output(City, method="json_mode").invoke(
        f"Describe a city. Answer with JSON like {EXAMPLE}")
    assert isinstance(city, City) and city.name
    assert sent.last["response_format"] == {"type": "json_object"}


# The SDK's parsed-completion type says ``parsed: None`` on the stream path; pydantic warns
# when langchain hands it the City (a client-side notice, nothing the server sends).
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_langchain_streams_the_structured_output(chat, sent):
    chunks = list(chat.with_structured_output(City).stream("Describe Paris as JSON."))
    assert sent.last["stream"] is True
    assert isinstance(chunks[-1], City)


def test_langchain_function_calling_is_a_forced_tool_call(chat, sent):
    """``method="function_calling"`` sends the model as a tool and names it in ``tool_choice``:
    the call is constrained to the tool's parameters (server/tools), so it parses and
    validates into the model."""
    city = chat.with_structured_output(City, method="function_calling").invoke(
        "Describe Paris.")
    assert isinstance(city, City)
    assert sent.last["tools"][0]["function"]["name"] == "City"
    assert sent.last["tool_choice"] in ("required", {"type": "function",
                                                     "function": {"name": "City"}})
