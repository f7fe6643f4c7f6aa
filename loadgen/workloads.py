"""Benchmark workloads: random prompts, shared-prefix groups, multi-turn chats, ``copy``
(input-grounded: a passage, then its first part again, so the answer continues copying the
prompt, the case speculative decoding's n-gram lookup is for), and ``agent`` (tool loops: every
conversation sends the same ~``tools_len`` tokens of function tools, then a growing history of
scripted tool calls and their results; see ``build_agent_sessions``).

Prompts are random sequences of common English words. With a tokenizer, a prompt is cut to
exactly the asked number of tokens (``Prompt.token_ids``) and its text is the decoding of those
ids; without one, a word stands for a token (most common words with a leading space are one
BPE token), and the server's usage report gives the true count. Everything is drawn from one
seeded ``random.Random``, so a seed reproduces the same workload.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

KINDS = ("random", "shared-prefix", "multi-turn", "copy", "agent")
TOOL_CHOICES = ("auto", "none", "required")

_WORDS = """the of and to in is was that for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water
than call first who may down side been now find any new work part take get place made live where
after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head stand own
page should country found answer school grow study still learn plant cover food sun four between
state keep eye never last let thought city tree cross farm hard start might story saw far sea draw
left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river
car feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song measure door product
black short numeral class wind question happen complete ship area half rock order fire south
problem piece told knew pass since top whole king space heard best hour better true during hundred
five remember step early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several vowel toward war lay against pattern slow center love person money
serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall
lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
drive stood contain front teach week final gave green quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat
snow tire bring yes distant fill east paint language among""".split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send. Lengths are tokens; ``prefix_len`` counts only for ``shared-prefix``;
    ``tools_len`` (the function tools' JSON), ``tool_result_len`` (each scripted tool result)
    and ``tool_choice`` only for ``agent``."""

    kind: str = "random"
    num_requests: int = 64
    input_len: int = 280
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_groups: int = 4
    num_turns: int = 4
    seed: int = 0
    tools_len: int = 2000
    tool_result_len: int = 150
    tool_choice: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}; "
                             f"got {self.tool_choice!r}")
        for name in ("num_requests", "input_len", "output_len", "num_groups", "num_turns",
                     "tools_len", "tool_result_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0; got {self.prefix_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1); got {self.range_ratio}")


@dataclass
class Prompt:
    """``token_ids`` is exact when a tokenizer made the prompt; ``num_tokens`` then equals its
    length, else it is the word count (an estimate)."""

    text: str
    num_tokens: int
    token_ids: list[int] | None = None

    def __add__(self, other: Prompt) -> Prompt:
        ids = (self.token_ids + other.token_ids
               if self.token_ids is not None and other.token_ids is not None else None)
        return Prompt(self.text + other.text, self.num_tokens + other.num_tokens, ids)


@dataclass
class RequestSpec:
    """One request: the whole prompt (completions) or this turn's user message (chat). An agent
    turn appends ``messages`` to the conversation instead (its ``prompt`` is then the text of
    the newest of them, for the token estimate)."""

    prompt: Prompt
    max_tokens: int
    group: int | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass
class Session:
    """Requests sent one after another: one for completions, one per turn for a chat, each turn
    resending the conversation so far."""

    index: int
    turns: list[RequestSpec] = field(default_factory=list)
    chat: bool = False
    tools: list[dict[str, Any]] | None = None  # agent: sent with every turn
    tool_choice: str | None = None
    tools_tokens: int = 0  # the tools' JSON, in tokens (an estimate without a tokenizer)


class PromptMaker:
    """Draws prompts of a given token length from the word list.

    With a tokenizer that encodes space-separated words independently (byte-level BPE does),
    a prompt is made of whole words, topped up with one-token words, so that the server's
    re-encoding of its text gives back exactly the same ids. Otherwise the ids are cut.
    """

    def __init__(self, tokenizer: Tokenizer | None, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self._word_ids: dict[str, list[int]] = {}
        self._one_token: list[str] = []
        if tokenizer is not None:
            self._word_ids = {w: tokenizer.encode(" " + w) for w in _WORDS}
            self._one_token = [w for w, ids in self._word_ids.items() if len(ids) == 1]
            probe = " " + " ".join(_WORDS[:64])
            additive = tokenizer.encode(probe) == [t for w in _WORDS[:64]
                                                   for t in self._word_ids[w]]
            if not additive or not self._one_token:
                self._word_ids = {}

    def make(self, num_tokens: int) -> Prompt:
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least one token; got {num_tokens}")
        if self.tokenizer is None:
            words = self.rng.choices(_WORDS, k=num_tokens)
            return Prompt(" " + " ".join(words), num_tokens)
        if self._word_ids:
            ids: list[int] = []
            while len(ids) < num_tokens:
                piece = self._word_ids[self.rng.choice(_WORDS)]
                if len(ids) + len(piece) > num_tokens:
                    piece = self._word_ids[self.rng.choice(self._one_token)]
                ids.extend(piece)
            return Prompt(self.tokenizer.decode(ids), num_tokens, ids)
        # A leading space keeps prompts concatenable (prefix + suffix) without merging tokens.
        text = " " + " ".join(self.rng.choices(_WORDS, k=num_tokens + 8))
        ids = self.tokenizer.encode(text)
        while len(ids) < num_tokens:
            text += " " + " ".join(self.rng.choices(_WORDS, k=num_tokens))
            ids = self.tokenizer.encode(text)
        ids = ids[:num_tokens]
        return Prompt(self.tokenizer.decode(ids), num_tokens, ids)

    def make_copy(self, num_tokens: int) -> Prompt:
        """``num_tokens`` of prompt: a passage of about two thirds of them, then the passage's
        beginning again (cut to fill the rest), so that its continuation is the passage."""
        if num_tokens < 2:
            return self.make(num_tokens)
        passage = self.make(max(1, num_tokens * 2 // 3))
        rest = num_tokens - passage.num_tokens
        if passage.token_ids is not None:
            ids = passage.token_ids[:rest]
            again = Prompt(self.tokenizer.decode(ids), len(ids), ids)
        else:
            words = passage.text.split()[:rest]
            again = Prompt(" " + " ".join(words), len(words))
        return passage + again

    def length(self, mean: int, ratio: float) -> int:
        if ratio <= 0:
            return mean
        lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
        return self.rng.randint(lo, hi)


def build_sessions(cfg: WorkloadConfig, tokenizer: Tokenizer | None) -> list[Session]:
    """The sessions of a run; their turns add up to exactly ``cfg.num_requests`` requests."""
    maker = PromptMaker(tokenizer, cfg.seed)
    if cfg.kind == "agent":
        return build_agent_sessions(cfg, maker)
    if cfg.kind in ("random", "copy"):
        make = maker.make if cfg.kind == "random" else maker.make_copy
        return [Session(i, [RequestSpec(make(maker.length(cfg.input_len, cfg.range_ratio)),
                                        maker.length(cfg.output_len, cfg.range_ratio))])
                for i in range(cfg.num_requests)]
    if cfg.kind == "shared-prefix":
        prefixes = [maker.make(cfg.prefix_len) if cfg.prefix_len else None
                    for _ in range(cfg.num_groups)]
        sessions = []
        for i in range(cfg.num_requests):
            g = i % cfg.num_groups
            suffix = maker.make(maker.length(cfg.input_len, cfg.range_ratio))
            prompt = prefixes[g] + suffix if prefixes[g] is not None else suffix
            sessions.append(Session(i, [RequestSpec(prompt, maker.length(
                cfg.output_len, cfg.range_ratio), group=g)]))
        return sessions
    sessions = []
    remaining = cfg.num_requests
    while remaining > 0:
        turns = min(cfg.num_turns, remaining)
        sessions.append(Session(len(sessions), [
            RequestSpec(maker.make(maker.length(cfg.input_len, cfg.range_ratio)),
                        maker.length(cfg.output_len, cfg.range_ratio)) for _ in range(turns)],
            chat=True))
        remaining -= turns
    return sessions


AGENT_SYSTEM = ("You are an agent that completes the user's task with the tools below. Call one "
                "tool at a time, read its result, then decide the next call; answer in text "
                "only when the task is done.")


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(_WORDS, k=rng.randint(lo, hi)))


def _property(rng: random.Random, kind: str, depth: int = 0) -> dict[str, Any]:
    """One parameter's JSON schema of ``kind``; ``object`` and ``array`` nest (once)."""
    desc = _words(rng, 6, 14).capitalize() + "."
    if kind == "string":
        return {"type": "string", "description": desc}
    if kind == "integer":
        lo = rng.randint(0, 10)
        return {"type": "integer", "description": desc, "minimum": lo,
                "maximum": lo + rng.randint(10, 1000)}
    if kind == "number":
        return {"type": "number", "description": desc}
    if kind == "boolean":
        return {"type": "boolean", "description": desc}
    if kind == "enum":
        return {"type": "string", "description": desc,
                "enum": sorted(set(rng.choices(_WORDS, k=rng.randint(3, 6))))}
    inner_kinds = ["string", "integer", "boolean", "enum"] + (["object"] if depth == 0 else [])
    props = {f"{w}_{i}": _property(rng, rng.choice(inner_kinds), depth + 1)
             for i, w in enumerate(rng.sample(_WORDS, rng.randint(2, 3)))}
    obj = {"type": "object", "description": desc, "properties": props,
           "required": sorted(props)[:1]}
    if kind == "array":
        return {"type": "array", "description": desc, "items": obj,
                "maxItems": rng.randint(2, 20)}
    return obj


_KINDS_REQUIRED = ("string", "integer", "enum")
_KINDS_OPTIONAL = ("string", "integer", "number", "boolean", "enum", "object", "array")


def make_tool(rng: random.Random, index: int) -> dict[str, Any]:
    """One OpenAI function tool: a description and 3-5 parameters, the first two required
    (simple types, which ``tool_arguments`` fills), the others of any kind, objects nested."""
    name = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{index}"
    kinds = [rng.choice(_KINDS_REQUIRED) for _ in range(2)] + [
        rng.choice(_KINDS_OPTIONAL) for _ in range(rng.randint(1, 3))]
    props = {f"{w}_{i}": _property(rng, k)
             for i, (w, k) in enumerate(zip(rng.sample(_WORDS, len(kinds)), kinds, strict=True))}
    return {"type": "function", "function": {
        "name": name, "description": _words(rng, 15, 30).capitalize() + ".",
        "parameters": {"type": "object", "properties": props, "required": list(props)[:2]}}}


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The tools as kvserve's default tool prompt lists them: one JSON object a line."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    """Exact with a tokenizer, else an estimate of 4 characters a token."""
    return len(tokenizer.encode(text)) if tokenizer is not None else max(1, len(text) // 4)


def make_tools(rng: random.Random, num_tokens: int, tokenizer: Tokenizer | None
               ) -> list[dict[str, Any]]:
    """Function tools whose JSON (``tools_text``) holds about ``num_tokens`` tokens: tools are
    added while the total stays nearer to it than without the next one."""
    tools = [make_tool(rng, 0)]
    size = count_tokens(tools_text(tools), tokenizer)
    while size < num_tokens:
        more = tools + [make_tool(rng, len(tools))]
        more_size = count_tokens(tools_text(more), tokenizer)
        if more_size - num_tokens > num_tokens - size:
            break
        tools, size = more, more_size
    return tools


def tool_arguments(rng: random.Random, tool: dict[str, Any]) -> dict[str, Any]:
    """Values for the tool's required parameters, valid for their schemas."""
    params = tool["function"]["parameters"]
    args: dict[str, Any] = {}
    for name in params["required"]:
        schema = params["properties"][name]
        if "enum" in schema:
            args[name] = rng.choice(schema["enum"])
        elif schema["type"] == "integer":
            args[name] = rng.randint(schema["minimum"], schema["maximum"])
        else:
            args[name] = _words(rng, 2, 5)
    return args


def build_agent_sessions(cfg: WorkloadConfig, maker: PromptMaker) -> list[Session]:
    """Agent conversations of ``cfg.num_turns`` requests each (``cfg.num_requests`` in all).

    Every conversation gets the same tools (``make_tools``, ~``cfg.tools_len`` tokens) and the
    same system prompt (``AGENT_SYSTEM``): the prefix all agents share. Turn 0 adds that system
    message and a user task of ``cfg.input_len`` tokens; turn k > 0 adds a scripted assistant
    message calling one of the tools (OpenAI shape: ``tool_calls`` with an id, arguments as
    JSON text) and the ``tool`` message answering it (``cfg.tool_result_len`` tokens). The
    model's own answers are not kept, so the history, and each turn's prompt, is the same for
    any server and run with the seed."""
    rng = maker.rng
    tools = make_tools(rng, cfg.tools_len, maker.tokenizer)
    tools_tokens = count_tokens(tools_text(tools), maker.tokenizer)
    sessions: list[Session] = []
    remaining = cfg.num_requests
    while remaining > 0:
        index = len(sessions)
        turns: list[RequestSpec] = []
        for k in range(min(cfg.num_turns, remaining)):
            out_len = maker.length(cfg.output_len, cfg.range_ratio)
            if k == 0:
                task = maker.make(maker.length(cfg.input_len, cfg.range_ratio))
                messages = [{"role": "system", "content": AGENT_SYSTEM},
                            {"role": "user", "content": "Task:" + task.text}]
                turns.append(RequestSpec(task, out_len, messages=messages))
                continue
            tool = rng.choice(tools)
            call_id = f"call_{index}_{k}"
            result = maker.make(maker.length(cfg.tool_result_len, cfg.range_ratio))
            messages = [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function", "function": {
                        "name": tool["function"]["name"],
                        "arguments": json.dumps(tool_arguments(rng, tool))}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "Result:" + result.text}]
            turns.append(RequestSpec(result, out_len, messages=messages))
        sessions.append(Session(index, turns, chat=True, tools=tools,
                                tool_choice=cfg.tool_choice, tools_tokens=tools_tokens))
        remaining -= len(turns)
    return sessions


def derive_seed(seed: int, *parts: object) -> int:
    """An independent seed for a sub-stream (a sweep point, the warm-up) of a run's seed."""
    import hashlib

    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def poisson_arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Arrival offsets in seconds: all zero when ``rate`` is None/inf, else a Poisson process."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0; got {rate}")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class HFTokenizer:
    """Adapter over a transformers tokenizer: no special tokens added, none skipped."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(spec: str | None) -> Tokenizer | None:
    """``'none'`` -> None (word-sized prompts); None -> the embedded model's tokenizer; else what
    the engine's loader finds at ``spec`` (a local HF dir or a .gguf file)."""
    if spec is not None and spec.lower() == "none":
        return None
    from engine.loading.loader import load_tokenizer as engine_tokenizer
    from engine.loading.loader import resolve_model

    return HFTokenizer(engine_tokenizer(resolve_model(spec)))
