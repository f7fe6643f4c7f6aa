"""Streaming client for OpenAI-compatible servers, timing every chunk of the answer.

Contract: ``complete``/``chat`` never raise for a failed request; they return a
``RequestRecord`` with ``ok=False`` and the reason (HTTP status and the server's error message,
an error event inside the stream, a timeout, a refused connection). Only the given base URL is
contacted.

Token counting: a chunk carries as many tokens as its ``logprobs`` list when the server sends
one, else one token if it has text; ``output_tokens`` is the server's ``usage.completion_tokens``
when reported, else the stream's count. ``openai_only`` sends nothing outside OpenAI's
documented request fields and asks for no usage (llama.cpp's server, transformers serve). TTFT
is the time to the first chunk that carries a token; a chat request with tools asks for
``logprobs`` so that a held-back tool call's tokens still show. ``ttft_first_chunk`` takes TTFT
at the stream's first chunk instead and asks no logprobs (llama-server, which refuses logprobs
with tools in a stream)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadgen.stats import RequestRecord


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    openai_only: bool = False
    timeout: float = 600.0
    temperature: float = 0.0
    ttft_first_chunk: bool = False  # TTFT at the stream's first chunk, not its first token
    # Completions prompts sent as their token ids (OpenAI's token-array prompt), so that two
    # servers whose tokenisers differ are given the very same prompt tokens.
    prompt_token_ids: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://; got {self.base_url!r}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds; got {self.timeout}")


def _root(base_url: str) -> str:
    """Accept both ``http://host:port`` and ``http://host:port/v1``."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class BenchClient:
    """One pooled HTTP connection set for a whole run. Use as ``async with BenchClient(cfg)``."""

    def __init__(self, cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None,
                 ) -> None:
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(
            base_url=_root(cfg.base_url), headers=headers, transport=transport,
            timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def list_models(self) -> list[str]:
        resp = await self.http.get("/v1/models")
        resp.raise_for_status()
        return [m["id"] for m in resp.json().get("data", [])]

    def _payload(self, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": max_tokens,
                                "temperature": self.cfg.temperature, "stream": True}
        if not self.cfg.openai_only:
            if ignore_eos:
                body["ignore_eos"] = True  # fixed output lengths make runs comparable
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, prompt: str | list[int], max_tokens: int,
                       expected_prompt_tokens: int = 0) -> RequestRecord:
        body = self._payload(max_tokens) | {"prompt": prompt}
        return await self._stream("/v1/completions", body, chat=False,
                                  expected=expected_prompt_tokens)

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int,
                   expected_prompt_tokens: int = 0, tools: list[dict[str, Any]] | None = None,
                   tool_choice: str | None = None) -> RequestRecord:
        """With ``tools``: sent with ``tool_choice``, and with ``logprobs`` so that the first
        token comes in a chunk of its own even when the server holds back its text (a tool
        call is streamed once whole); no ``ignore_eos`` (the output may end with a call)."""
        body = self._payload(max_tokens, ignore_eos=tools is None) | {"messages": messages}
        if tools is not None:
            body["tools"] = tools
            if not self.cfg.ttft_first_chunk:
                body["logprobs"] = True
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        return await self._stream("/v1/chat/completions", body, chat=True,
                                  expected=expected_prompt_tokens)

    async def _stream(self, path: str, body: dict[str, Any], *, chat: bool,
                      expected: int) -> RequestRecord:
        start = time.perf_counter()
        rec = RequestRecord(ok=False, start=start, end=start, expected_prompt_tokens=expected,
                            max_tokens=int(body["max_tokens"]))
        parts: list[str] = []
        last_token_time: float | None = None
        done = False
        try:
            async with self.http.stream("POST", path, json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                    return _finish(rec, parts)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    if self.cfg.ttft_first_chunk and rec.ttft is None:
                        rec.ttft = now - start
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec.error = f"stream error: {_error_message(obj)}"
                        return _finish(rec, parts)
                    if obj.get("usage"):
                        _read_usage(rec, obj["usage"])
                    for choice in obj.get("choices") or []:
                        text, ntok = _chunk_tokens(choice, chat)
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                        if ntok == 0:
                            continue
                        parts.append(text)
                        rec.stream_tokens += ntok
                        if last_token_time is None:
                            if rec.ttft is None:
                                rec.ttft = now - start
                        else:
                            rec.itl.append(now - last_token_time)
                        last_token_time = now
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
            return _finish(rec, parts)
        if not done and rec.finish_reason is None:
            rec.error = "stream ended without a finish_reason or [DONE]"
            return _finish(rec, parts)
        rec.ok = True
        return _finish(rec, parts)


def _finish(rec: RequestRecord, parts: list[str]) -> RequestRecord:
    rec.end = time.perf_counter()
    rec.text = "".join(parts)
    rec.output_tokens = (rec.usage_completion_tokens if rec.usage_completion_tokens is not None
                         else rec.stream_tokens)
    return rec


def _chunk_tokens(choice: dict[str, Any], chat: bool) -> tuple[str, int]:
    """(text, number of tokens) carried by one streamed choice."""
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
        lp = choice.get("logprobs") or {}
        tokens = lp.get("content") if isinstance(lp, dict) else None
    else:
        text = choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") if isinstance(lp, dict) else None
    if tokens:
        return text, len(tokens)
    return text, 1 if text else 0


def _read_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    if usage.get("completion_tokens") is not None:
        rec.usage_completion_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _error_message(raw: bytes | dict[str, Any]) -> str:
    try:
        obj = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
    except (ValueError, TypeError):
        return raw[:200].decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)[:200]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)[:200]
    return str(err)[:200]
