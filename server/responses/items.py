"""Items of the Responses API: a request's ``input`` read into normalised items
(:func:`read_input`, which lists the accepted shapes), items turned into chat messages (the
conversation the chat template renders: :func:`chat_messages`), and a finished output turned
into output items (:func:`output_items`).

Normalised items are the API's own shapes, each with an ``id`` (kept when given): what
``GET /v1/responses/{id}/input_items`` lists. Text parts, and ``input_image`` parts in user
messages (their shape only: server/media checks what they point at, and refuses images for a
model that takes none); files and audio are refused, each break a ``FieldError`` naming
``input.<i>...``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from server.field_error import FieldError
from server.tools.parser import ToolCall

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def read_input(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as normalised items (each break a ``FieldError`` naming
    ``input.<i>...``):

    * a string ``input``: one user message;
    * a message, ``{"role": "user"|"system"|"developer"|"assistant", "content": str | [parts]}``
      (``"type": "message"`` optional); text parts (``input_text``, ``output_text``,
      ``text``, ``refusal``) and, in a user message, ``input_image`` parts (``image_url`` or
      ``file_id``, ``detail``; kept as parts); files and audio are refused;
    * ``{"type": "function_call", "call_id", "name", "arguments"}``: a call the model made;
    * ``{"type": "function_call_output", "call_id", "output"}``: its result (text, or parts);
    * ``{"type": "reasoning", "content": [{"type": "reasoning_text", "text"}], "summary":
      [...]}``: a thought the model had; it becomes the next assistant message's
      ``reasoning_content``, which the chat template renders where it takes it (Qwen3's does
      for the turn in progress) and ignores otherwise. Its text is the ``reasoning_text``
      parts, else the summary's texts; an item with no text (empty, or only
      ``encrypted_content``) is left out."""
    if isinstance(value, str):
        return [_message("user", value, None)]
    if not isinstance(value, list):
        raise FieldError("input", "must be a string or a list of items")
    return [item for i, raw in enumerate(value) if (item := _item(raw, f"input.{i}"))]


def _item(raw: Any, where: str) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        raise FieldError(where, "must be an object (a message or a function_call / "
                                "function_call_output item)")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        role = raw.get("role")
        if role not in ROLES:
            raise FieldError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        content = raw.get("content")
        if role == "user" and isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "input_image" for p in content):
            return _image_message(content, f"{where}.content", raw.get("id"))
        return _message(role, _text(content, f"{where}.content"), raw.get("id"))
    if kind == "function_call":
        call_id, name = _string(raw, "call_id", where), _string(raw, "name", where)
        arguments = _string(raw, "arguments", where)
        return {"type": "function_call", "id": raw.get("id") or item_id("fc"),
                "call_id": call_id, "name": name, "arguments": arguments,
                "status": "completed"}
    if kind == "function_call_output":
        call_id = _string(raw, "call_id", where)
        output = raw.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        return {"type": "function_call_output", "id": raw.get("id") or item_id("fco"),
                "call_id": call_id, "output": text, "status": "completed"}
    if kind == "reasoning":
        return _reasoning(raw, where)
    if kind == "item_reference":
        raise FieldError(f"{where}.type", "item references are not supported: send the item "
                                          "itself, or continue with previous_response_id")
    raise FieldError(f"{where}.type", f"{kind!r} items are not supported; input items are "
                                      "messages, function_call and function_call_output")


def _string(raw: dict[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise FieldError(f"{where}.{key}", "must be a non-empty string" if key != "arguments"
                         else "must be a string (the arguments as JSON text)")
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(where, "must be a string or a list of text parts")
    return "\n".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _part_text(part: Any, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise FieldError(f"{at}.type", f"only text content (and input_image in user "
                                       f"messages) is supported; got {kind!r}")
    text = part.get("refusal" if kind == "refusal" else "text")
    if not isinstance(text, str):
        raise FieldError(f"{at}.text", "must be a string")
    return text


def _image_message(content: list[Any], where: str, given_id: Any) -> dict[str, Any]:
    """A user message with images: its parts kept in order, text as ``input_text`` and images
    as ``input_image`` (shape only: what they point at is checked by server/media)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url, file_id = part.get("image_url"), part.get("file_id")
            if not isinstance(url, str) and not isinstance(file_id, str):
                raise FieldError(f"{where}.{j}.image_url", "an input_image part needs "
                                                           "image_url (a URL string)")
            kept = {k: part[k] for k in ("image_url", "file_id", "detail") if k in part}
            parts.append({"type": "input_image", **kept})
        else:
            parts.append({"type": "input_text", "text": _part_text(part, f"{where}.{j}")})
    return {"type": "message", "id": given_id if isinstance(given_id, str) and given_id
            else item_id("msg"), "role": "user", "status": "completed", "content": parts}


def _reasoning(raw: dict[str, Any], where: str) -> dict[str, Any] | None:
    parts = raw.get("content") or []
    summary = raw.get("summary") or []
    if not isinstance(parts, list) or not isinstance(summary, list):
        raise FieldError(where, "a reasoning item's content and summary must be lists of parts")
    texts = [p.get("text") for p in parts if isinstance(p, dict)] or \
        [p.get("text") for p in summary if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise FieldError(f"{where}.content", "reasoning parts need a text string")
    if not any(texts):  # nothing to give the template (an encrypted or empty item)
        return None
    return {"type": "reasoning", "id": raw.get("id") or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": "\n".join(texts)}],
            "status": "completed"}


def _message(role: str, text: str, given_id: Any) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part["annotations"] = []
    return {"type": "message", "id": given_id if isinstance(given_id, str) and given_id
            else item_id("msg"), "role": role, "status": "completed", "content": [part]}


def message_text(item: dict[str, Any]) -> str:
    return "\n".join(p.get("text", p.get("refusal", "")) for p in item["content"]
                     if p.get("type") != "input_image")


def _chat_content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    """A message item's chat content: its text, or with images the chat API's parts."""
    if not any(p.get("type") == "input_image" for p in item["content"]):
        return message_text(item)
    parts: list[dict[str, Any]] = []
    for p in item["content"]:
        if p.get("type") != "input_image":
            parts.append({"type": "text", "text": p["text"]})
        elif isinstance(p.get("image_url"), str):
            image = {"url": p["image_url"], **({"detail": p["detail"]} if "detail" in p else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:  # server/media refuses a file_id before a conversation is written
            raise ValueError("an input_image with a file_id has no chat form")
    return parts


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised items (input or output) as ``/v1/chat/completions`` messages: a
    function_call joins the assistant message before it (the model's text, then its calls) or
    opens one; a function_call_output becomes a ``tool`` message."""
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought = message_text(item)
            continue
        extra = {"reasoning_content": thought} if thought is not None else {}
        if kind == "message":
            out.append({"role": item["role"], "content": _chat_content(item),
                        **(extra if item["role"] == "assistant" else {})})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not extra:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],
                            **extra})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
        if kind != "function_call_output" and (kind != "message" or
                                               item["role"] == "assistant"):
            thought = None
    return out


def output_items(content: str | None, calls: tuple[ToolCall, ...], call_id: Callable[[], str]
                 ) -> list[dict[str, Any]]:
    """A finished output as output items: its text as an assistant message (when there is text
    or no call), then one function_call per call (``call_id`` makes each call's id: the tool
    format's, as some chat templates accept only their own)."""
    items: list[dict[str, Any]] = []
    if content or not calls:
        items.append(_message("assistant", content or "", None))
    items.extend(function_call_item(call, call_id()) for call in calls)
    return items


def function_call_item(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def size_of(obj: Any) -> int:
    """Bytes of ``obj`` as compact JSON (what the response store counts)."""
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
