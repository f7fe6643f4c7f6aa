"""The bodies of ``POST /v1/messages`` and ``/v1/messages/count_tokens``, and their
translation into a ``/v1/chat/completions`` body (``chat_body``), so that the chat template,
tool calling, constraints and the reasoning split behave exactly as they do there.

The mapping (docs/anthropic.md has the user's version; field by field on :func:`chat_messages`
and :meth:`MessagesRequest.chat_body`): ``system`` and ``messages`` -> chat messages, ``tools``
and ``tool_choice`` -> function tools, ``thinking`` -> the template's ``enable_thinking`` and
the chat request's ``thinking_token_budget``, ``output_config.format`` -> ``response_format``,
the sampling fields and kvserve's extras (``PASSTHROUGH``) as they are.

Image blocks in user messages (``source`` ``base64`` or ``url``) become the chat API's
``image_url`` parts; the route checks them (server/media) and refuses images for a model that
takes none, naming ``messages.<i>.content.<j>.source...``. Refused with a 400: document and
other non-text blocks (and images elsewhere: assistant messages, tool results), server tools (``web_search``,
``bash``, ... any ``type`` but ``custom``), ``system`` or other roles in ``messages``, a
``tool_result`` that answers no earlier ``tool_use``. Other fields (``cache_control``,
``service_tier``, ``container``, ``mcp_servers``, ...) are accepted and ignored."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictInt, StrictStr, model_validator

from server.field_error import FieldError
from server.media.collect import anthropic_source_ref
from server.media.errors import MediaError
from server.protocol import _Body, _Request

# kvserve's own sampling fields a Messages request may carry along (as extra body fields).
PASSTHROUGH = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "stop_token_ids", "logit_bias", "ignore_eos", "min_tokens", "priority",
               "cache_salt", "skip_special_tokens")
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: a Messages request without the generation
    fields."""

    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_parts(self) -> CountTokensRequest:
        self._chat_messages = chat_messages(self.system, self.messages)
        self._tools = [_tool(i, t) for i, t in enumerate(self.tools or [])]
        self._thinking = _thinking(self.thinking)
        _choice(self.tool_choice)  # checked here: a 400 naming Anthropic's field
        return self

    def chat_body(self, *, counting: bool = True) -> dict[str, Any]:
        """The ``/v1/chat/completions`` body of this request (for counting: no tool
        constraint, which changes nothing in the prompt)."""
        messages: list[dict[str, Any]] = self._chat_messages
        prefill = messages[-1]["role"] == "assistant"
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": not prefill,
                                "continue_final_message": prefill}
        extra = self.model_extra or {}
        body.update({k: extra[k] for k in PASSTHROUGH if k in extra})
        kwargs = dict(extra.get("chat_template_kwargs") or {})
        if self._thinking is not None:
            kwargs["enable_thinking"] = self._thinking
            if not self._thinking:
                body["include_reasoning"] = False
        budget = (self.thinking or {}).get("budget_tokens")
        if self._thinking and budget is not None:
            body["thinking_token_budget"] = budget
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if self._tools:
            body["tools"] = self._tools
            choice, parallel = _choice(self.tool_choice)
            body["tool_choice"] = "none" if counting else choice
            if parallel is False:
                body["parallel_tool_calls"] = False
        return body

    @property
    def shows_thinking(self) -> bool:
        """Whether a thought comes back as ``thinking`` blocks (not with thinking disabled)."""
        return self._thinking is not False

    @property
    def omits_thinking(self) -> bool:
        """``thinking.display: "omitted"``: thinking blocks come back empty (signature only)."""
        return (self.thinking or {}).get("display") == "omitted"


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_format(self) -> MessagesRequest:
        fmt = (self.output_config or {}).get("format")
        self._format = _response_format(fmt) if fmt is not None else None
        return self

    def chat_body(self, *, counting: bool = False) -> dict[str, Any]:
        """The chat body, the messages as :func:`chat_messages` writes them and:

        * ``tools`` (``{"name", "description"?, "input_schema"}``) -> function tools;
          ``tool_choice`` ``auto`` | ``any`` | ``tool`` | ``none`` -> ``auto`` | ``required`` |
          a named function | ``none``; ``disable_parallel_tool_use`` ->
          ``parallel_tool_calls: false``;
        * ``max_tokens``, ``stop_sequences`` (-> ``stop``), ``temperature``, ``top_p``,
          ``top_k``; ``metadata.user_id`` -> ``user``;
        * ``thinking`` ``{"type": "enabled", "budget_tokens": N}`` (or ``adaptive``,
          ``between_tools``) -> the template variable ``enable_thinking: true``,
          ``budget_tokens`` -> the chat request's ``thinking_token_budget`` (the thought's
          closing marker is forced after that many tokens: server/reasoning/gate.py);
          ``{"type": "disabled"}`` -> ``enable_thinking: false`` and any thought left out of the
          answer; ``display: "omitted"`` sends thinking blocks with an empty thought;
        * ``output_config.format`` (``{"type": "json_schema", "schema"}``) ->
          ``response_format`` (the answer constrained to the schema); ``effort`` is ignored;
        * kvserve's sampling extras (``seed``, ``min_p``, ``chat_template_kwargs``, ...:
          PASSTHROUGH) pass through, as on the Responses API."""
        body = super().chat_body(counting=counting)
        body.update(max_tokens=self.max_tokens, stream=self.stream)
        if self._format is not None:
            body["response_format"] = self._format
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.top_k:  # 0: no top-k
            body["top_k"] = self.top_k
        user = (self.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
        return body


def chat_messages(system: str | list[dict[str, Any]] | None,
                  messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The conversation as ``/v1/chat/completions`` messages:

    * ``system`` (a string or text blocks) -> a first ``system`` message;
    * a ``user`` message's text and image blocks -> a ``user`` message (text parts, images as
      ``image_url`` parts; a text-only one's blocks joined by newlines when rendered); each
      ``tool_result`` block -> a ``tool`` message answering its ``tool_use_id`` (its text; with
      ``is_error`` prefixed ``Error: ``);
    * an ``assistant`` message's text -> its content, each ``tool_use`` block -> a tool call
      (``input`` as JSON arguments); ``thinking`` / ``redacted_thinking`` blocks are left out
      of the prompt (the templates of thinking models drop past thoughts); a last
      ``assistant`` message is a prefill: the output continues it
      (``continue_final_message``)."""
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "\n".join(
            _text_of(b, f"system.{i}") for i, b in enumerate(system))
        out.append({"role": "system", "content": text})
    calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_user_messages(m.content, where, calls))
        else:
            out.append(_assistant_message(m.content, where, calls))
    if out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        raise FieldError(f"messages.{len(messages) - 1}", "the last message is an assistant "
                         "message with tool_use blocks: a user message with their tool_result "
                         "blocks must follow")
    if all(m["role"] == "system" for m in out):
        raise FieldError("messages", "must hold at least one user or assistant message")
    return out


def _user_messages(blocks: list[dict[str, Any]], where: str, calls: set[str]
                   ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if block.get("type") == "tool_result":
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append(_tool_message(block, at, calls))
        elif block.get("type") == "image":
            texts.append(_image_part(block, at))
        else:
            texts.append({"type": "text", "text": _text_of(block, at)})
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as the chat API's ``image_url`` part (a base64 source as a data: URL);
    its shape checked here, what it holds by server/media."""
    try:
        ref = anthropic_source_ref(block.get("source"), f"{at}.source")
    except MediaError as exc:
        raise FieldError(exc.field, exc.message) from None
    return {"type": "image_url", "image_url": {"url": ref.ref}}


def _tool_message(block: dict[str, Any], at: str, calls: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise FieldError(f"{at}.tool_use_id", "a tool_result needs the tool_use_id of the "
                                              "tool_use it answers")
    if call_id not in calls:
        raise FieldError(f"{at}.tool_use_id", f"{call_id!r} answers no tool_use block of an "
                                              "earlier assistant message")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text_of(b, f"{at}.content.{k}") for k, b in enumerate(content))
    else:
        raise FieldError(f"{at}.content", "must be a string or a list of text blocks")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_message(blocks: list[dict[str, Any]], where: str, calls: set[str]
                       ) -> dict[str, Any]:
    texts: list[dict[str, str]] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.{j}", block.get("type")
        if kind in ("thinking", "redacted_thinking"):
            continue  # past thoughts stay out of the prompt
        if kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise FieldError(f"{at}.id", "a tool_use block needs a string id")
            if not isinstance(name, str):
                raise FieldError(f"{at}.name", "a tool_use block needs a string name")
            if not isinstance(args, dict):
                raise FieldError(f"{at}.input", "must be an object")
            calls.add(call_id)
            tool_calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            texts.append({"type": "text", "text": _text_of(block, at)})
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    elif not texts:
        message["content"] = ""
    return message


def _text_of(block: Any, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise FieldError(f"{at}.type", f"{kind!r} blocks are not supported here: only text, "
                                       "tool_use, tool_result and thinking blocks are")
    text = block.get("text")
    if not isinstance(text, str):
        raise FieldError(f"{at}.text", "a text block needs a string text")
    return text


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """An Anthropic client tool as a chat function tool (checked by server.tools.request)."""
    where = f"tools.{i}"
    if not isinstance(tool, dict):
        raise FieldError(where, "must be an object")
    if tool.get("type", "custom") not in ("custom", None):
        raise FieldError(f"{where}.type", f"server tools ({tool.get('type')!r}) are not "
                                          "supported: only client tools, {\"name\", "
                                          "\"description\", \"input_schema\"}")
    fn: dict[str, Any] = {"name": tool.get("name")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if tool.get("input_schema") is not None:
        fn["parameters"] = tool["input_schema"]
    return {"type": "function", "function": fn}


def _choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """The chat tool_choice and parallel_tool_calls of an Anthropic ``tool_choice``."""
    if choice is None:
        return "auto", None
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("tool_choice.disable_parallel_tool_use", "must be true or false")
    allowed = None if parallel is None else not parallel
    if kind in _CHOICES:
        return _CHOICES[kind], allowed
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise FieldError("tool_choice.name", "a tool choice of type 'tool' names the tool")
        return {"type": "function", "function": {"name": name}}, allowed
    raise FieldError("tool_choice.type", "must be one of auto, any, tool or none")


def _response_format(fmt: Any) -> dict[str, Any]:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``) as the chat request's
    ``response_format``."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise FieldError("output_config.format", 'must be {"type": "json_schema", "schema": '
                                                 '{...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """``enable_thinking`` for the template: True, False, or None (not given)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise FieldError("thinking.display", "must be summarized or omitted")
    if kind in ("adaptive", "between_tools"):
        return True
    if kind != "enabled":
        raise FieldError("thinking.type", "must be enabled, adaptive, between_tools or "
                                          "disabled")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise FieldError("thinking.budget_tokens", "must be a positive integer")
    return True
