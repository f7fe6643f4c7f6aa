"""The body of ``POST /v1/responses`` and its translation into a chat request.

A Responses request is served by the chat machinery: ``chat_body`` writes the conversation
(``instructions`` as a system message, the predecessor's items, this request's input items)
and the options as a ``/v1/chat/completions`` body, so the chat template, tool calling and
structured outputs behave exactly as they do there.

Honoured: ``model``, ``input``, ``instructions``, ``previous_response_id``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
``json_schema``), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``metadata``, ``user``; vLLM's sampling extras pass through. Accepted with no effect:
``include`` (only ``[]``), ``reasoning``, ``max_tool_calls``, ``truncation: "disabled"``,
``service_tier``, ``prompt_cache_key`` and the like. Refused with a 400: built-in tools,
``background``, ``conversation``, ``prompt``, ``truncation: "auto"``, ``top_logprobs``, other
``include`` values."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from server.field_error import FieldError
from server.protocol import _Request
from server.responses.items import chat_messages, read_input
from server.tools.request import read_tool_set

# Fields of a chat request a Responses request may carry along (vLLM's extras).
PASSTHROUGH = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "stop", "stop_token_ids", "logit_bias", "ignore_eos",
               "min_tokens", "priority", "cache_salt", "skip_special_tokens",
               "chat_template_kwargs")
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        refused = {"background": bool(self.background),
                   "conversation": self.conversation is not None,
                   "prompt": self.prompt is not None,
                   "top_logprobs": bool(self.top_logprobs),
                   "include": bool(self.include)}
        for name, present in refused.items():
            if present:
                raise FieldError(name, f"{name} is not supported by this server")
        if self.truncation == "auto":
            raise FieldError("truncation", "'auto' is not supported: the conversation is never "
                                           "truncated (a prompt over the model's context is a "
                                           "400); use 'disabled'")
        if self.metadata is not None:
            _check_metadata(self.metadata)
        self._items = read_input(self.input)
        self._chat_tools = _chat_tools(self.tools)
        self._chat_choice = _chat_choice(self.tool_choice)
        try:
            read_tool_set(self._chat_tools, self._chat_choice, self.parallel_tool_calls)
        except FieldError as exc:  # named as the Responses API writes the field
            param = (exc.param or "").replace(".function.", ".")
            raise FieldError(param, str(exc).split(": ", 1)[-1]) from None
        self._response_format = _response_format(self.text)
        return self

    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as normalised items (server.responses.items)."""
        return self._items

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """A ``/v1/chat/completions`` body for this request after ``history`` (the
        predecessor's conversation as chat messages, without its instructions)."""
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else [])
        messages += history + chat_messages(self._items)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        optional = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "tools": self._chat_tools,
                    "tool_choice": self._chat_choice,
                    "parallel_tool_calls": self.parallel_tool_calls,
                    "response_format": self._response_format, "user": self.user}
        body.update({k: v for k, v in optional.items() if v is not None})
        extra = self.model_extra or {}
        body.update({k: extra[k] for k in PASSTHROUGH if k in extra})
        return body

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "max_tool_calls": self.max_tool_calls, "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": None, "summary": None},
                "temperature": self.temperature, "top_p": self.top_p,
                "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
                "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
                "tools": self.tools or [], "truncation": self.truncation or "disabled",
                "user": self.user}


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > _METADATA_PAIRS:
        raise FieldError("metadata", f"at most {_METADATA_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE:
            raise FieldError(f"metadata.{key[:_METADATA_KEY]}",
                             f"keys are at most {_METADATA_KEY} characters and values at most "
                             f"{_METADATA_VALUE}")


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat API's nested shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise FieldError(f"tools.{i}.type", f"{kind!r} tools are not supported by this "
                                                "server (no built-in tools); only function "
                                                'tools: {"type": "function", "name": ...}')
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_choice(choice: str | dict[str, Any] | None) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise FieldError("tool_choice", f"{choice.get('type')!r} is not supported; tool_choice "
                                        "is none, auto, required or "
                                        '{"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise FieldError("text.format.type", "must be text, json_object or json_schema")
