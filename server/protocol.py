"""Request bodies of the OpenAI-compatible API (pydantic v2), and their SamplingParams.

Unknown fields are accepted and ignored (``extra="allow"``), as OpenAI's clients send fields
that a server may not know. No string anywhere in a body may hold a lone UTF-16 surrogate
(JSON's ``"\\ud800"``): it is not text, and no tokenizer or JSON encoder takes it (400). Fields that
would change the meaning of a request and that we do not implement (``suffix``, audio or
file content, ...) are rejected with a clear 400 instead of being silently dropped, and so are an
empty ``cache_salt`` (it would share the prefix cache with unsalted requests) and empty stop
strings. Chat content parts are text and, in user messages, ``image_url`` (its shape checked
here; what it points at by server/media, whose gate refuses images for a model that takes
none); other part types (``input_audio``, ``file``, ...) are refused. Chat requests
take function ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (validated by
server/tools/request.py), assistant messages with ``tool_calls`` and ``tool`` messages
answering them. Responses are plain dicts built in completions.py / chat.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.params.json_depth import deeper_than
from engine.params.sampling import SamplingParams
from engine.params.structured import StructuredSpec
from server.field_error import FieldError
from server.structured_forms import structured_spec
from server.tools.request import ToolSet, check_tool_results, read_tool_set

__all__ = ["FieldError"]  # re-exported: server.errors and the tests import it from here

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
NonNegInt = Annotated[StrictInt, Field(ge=0)]
# /tokenize and /detokenize: the most characters (over all messages) / token ids one call takes.
MAX_TOKENIZE_CHARS = 1_000_000
MAX_DETOKENIZE_IDS = 1_000_000
# Objects and arrays nested in one body: a schema inside a request sits a few levels down and
# may itself nest engine.params.structured.MAX_SCHEMA_DEPTH.
MAX_BODY_DEPTH = 100


_TEXT_HOLDERS = (str, dict, list)


def lone_surrogate(value: Any) -> tuple[str | None, str] | None:
    """``(path, message)`` for the first string (value or key) in a JSON-like value that holds
    a lone surrogate, else None. The message never holds the surrogate itself."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            bad = _surrogate_at(v)
            if bad is not None:
                return path, (f"holds a lone surrogate (U+{ord(v[bad]):04X} at character "
                              f"{bad}), which is not valid Unicode: send well-formed UTF-8 text")
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                key = str(k)
                if _surrogate_at(key) is not None:
                    return (path or None, "has a field name that holds a lone surrogate, which "
                            "is not valid Unicode: send well-formed UTF-8 text")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):  # only what can hold text (a token-id list holds none)
            stack.extend(reversed([(f"{path}.{i}", item) for i, item in enumerate(v)
                                   if isinstance(item, _TEXT_HOLDERS)]))
    return None


def _surrogate_at(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Request(_Body):
    """A whole request body (not a nested part)."""

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        deep = deeper_than(data, MAX_BODY_DEPTH)
        if deep is not None:  # before anything walks it recursively
            raise FieldError(deep.split(".")[0], f"the body nests more than {MAX_BODY_DEPTH} "
                                                 f"levels deep (at {deep[:120]})")
        found = lone_surrogate(data)
        if found is not None:
            raise FieldError(*found)
        return data


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Structured outputs (server.structured_forms): OpenAI's, vLLM's and llama.cpp's forms.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    grammar: StrictStr | None = None
    json_schema: dict[str, Any] | StrictStr | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v == "":  # as vLLM: "" is no salt, and would share the cache with unsalted requests
            raise ValueError("must not be empty: leave cache_salt out for no salt")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            for key, val in v.items():
                try:
                    tok = int(key)
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids; got {key!r}") from None
                if tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0; got {key!r}")
                if not -100.0 <= val <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100]; got {val}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingFields:
        self._structured = structured_spec(self)  # FieldError (a 400) on a bad form
        return self

    @property
    def structured(self) -> StructuredSpec | None:
        """The request's structured-output constraint, if any (server.structured_forms)."""
        return getattr(self, "_structured", None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: Mapping[str, float] | None = None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError (a 400) on inconsistent values.
        ``defaults`` (the model's generation config: temperature, top_p, top_k, min_p,
        repetition_penalty) fill the fields this request left out, before OpenAI's."""
        d = defaults or {}

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", -1)),
            min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias
            else None,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            cache_salt=self.cache_salt,
            structured=self.structured,
        )


Prompt = StrictStr | list[StrictStr] | list[NonNegInt] | list[list[NonNegInt]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (only best_of == n); got best_of="
                             f"{self.best_of}, n={self.n}")
        p = self.prompt
        if isinstance(p, str) or not p:
            if not p:
                raise ValueError("prompt must not be empty")
        elif isinstance(p[0], list) and any(not sub for sub in p):
            raise ValueError("prompt must not hold an empty list of token ids")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallItem(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant messages only
    tool_call_id: StrictStr | None = None  # tool messages: the call they answer
    # an assistant turn's thought given back (vLLM's field; ``reasoning`` its newer alias):
    # passed to the chat template, which may render it (Qwen3's does for the current turn)
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if (self.reasoning_content is not None or self.reasoning is not None) and \
                self.role != "assistant":
            raise ValueError("only assistant messages may carry reasoning_content")
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError("a tool message needs the tool_call_id of the call it answers")
            if self.content is None:
                raise ValueError("a tool message needs content (the call's result)")
        return self

    @field_validator("content")
    @classmethod
    def _parts(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, list):
            role = info.data.get("role")
            for part in v:
                _check_part(part, role)
        return v

    @property
    def has_images(self) -> bool:
        """Whether the content holds an ``image_url`` part."""
        return isinstance(self.content, list) and any(
            part.get("type") == "image_url" for part in self.content)

    def text_chars(self) -> int:
        """Characters of the message's text (its text parts; images not counted)."""
        if self.content is None:
            return 0
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p["text"]) for p in self.content if p.get("type") == "text")

    def text(self) -> str:
        """The message's text: its content, or its text parts joined by newlines. A message
        with images has no text-only form: ``RuntimeError`` (images reach the model only through
        server/media, whose gate refuses them before any text-only code runs)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if self.has_images:
            raise RuntimeError("a message with image_url parts reached text-only code: its "
                               "images must go through server/media (the gate refuses them "
                               "for a text-only model)")
        return "\n".join(part["text"] for part in self.content)

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as the chat template gets it: :meth:`text`, or for a message with
        images its parts in order, text as ``{"type": "text", "text": ...}`` and each image as
        ``{"type": "image"}`` (HF's convention; the template writes the model's image marker,
        server/media/prompt.py expands it)."""
        if not self.has_images:
            return self.text()
        return [{"type": "image"} if p.get("type") == "image_url" else
                {"type": "text", "text": p["text"]} for p in self.content]


_PART_TYPES = ("text", "image_url")
_DETAILS = ("auto", "low", "high")


def _check_part(part: Any, role: str | None) -> None:
    """A chat content part's shape (ValueError saying what is wrong): ``{"type": "text",
    "text": str}``, or in a user message ``{"type": "image_url", "image_url": {"url": str,
    "detail"?: auto|low|high}}`` (``"image_url": str`` accepted too). What the image URL
    points at is checked later (server/media)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        return
    if kind != "image_url":
        raise ValueError(f"content part type {kind!r} is not supported: parts are text and "
                         f"(in user messages) image_url")
    if role != "user":
        raise ValueError(f"image_url parts are only allowed in user messages, not in a "
                         f"{role} message")
    image = part.get("image_url")
    if isinstance(image, dict):
        if not isinstance(image.get("url"), str) or not image["url"]:
            raise ValueError("an image_url content part needs image_url.url (a data: or "
                             "http(s) URL string)")
        detail = image.get("detail")
        if detail is not None and detail not in _DETAILS:
            raise ValueError(f"image_url.detail must be one of {', '.join(_DETAILS)}; got "
                             f"{detail!r}")
    elif not isinstance(image, str) or not image:
        raise ValueError("an image_url content part needs image_url: {\"url\": ...} (a data: "
                         "or http(s) URL string)")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    documents: list[dict[str, Any]] | None = None  # likewise
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (server/reasoning)
    # vLLM's: the thought's tokens before its closing marker is forced (server/reasoning/gate.py)
    thinking_token_budget: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        self._tool_set = read_tool_set(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self._tool_set is not None and self._tool_set.calls_expected and self.structured:
            raise FieldError("tools", "a request may carry one constraint: tools (with "
                                      "tool_choice other than 'none') and a structured-output "
                                      "format cannot be combined")
        check_tool_results(self.messages)
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else \
            self.max_tokens

    @property
    def tool_set(self) -> ToolSet | None:
        """The request's tools and tool choice (server.tools.request), None without tools."""
        return getattr(self, "_tool_set", None)

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts ("developer" is OpenAI's new "system"): ``role`` and
    ``content`` (text), plus an assistant's ``tool_calls`` (OpenAI's shape) and
    ``reasoning_content`` (its thought, given back) and a tool message's ``tool_call_id``; server.tools.prompt shapes them for the chat template."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.template_content()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump(include={"id", "type", "function"})
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None:
            d["reasoning_content"] = thought
        out.append(d)
    return out


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        chars = len(self.prompt) if self.prompt is not None else \
            sum(m.text_chars() for m in self.messages or [])
        if chars > MAX_TOKENIZE_CHARS:
            raise FieldError("prompt" if self.prompt is not None else "messages",
                             f"{chars} characters; /tokenize takes at most "
                             f"{MAX_TOKENIZE_CHARS} per call")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[NonNegInt] = Field(max_length=MAX_DETOKENIZE_IDS)
