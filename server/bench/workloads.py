"""Benchmark workloads: random prompts, shared-prefix groups, multi-turn chats, and ``copy``
(input-grounded: a passage, then its first part again, so the answer continues copying the
prompt, the case speculative decoding's n-gram lookup is for).

Prompts are random sequences of common English words. With a tokenizer, a prompt is cut to
exactly the asked number of tokens (``Prompt.token_ids``) and its text is the decoding of those
ids; without one, a word stands for a token (most common words with a leading space are one
BPE token), and the server's usage report gives the true count. Everything is drawn from one
seeded ``random.Random``, so a seed reproduces the same workload.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

KINDS = ("random", "shared-prefix", "multi-turn", "copy")

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
    """What to send. Lengths are tokens; ``prefix_len`` counts only for ``shared-prefix``."""

    kind: str = "random"
    num_requests: int = 64
    input_len: int = 280
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_groups: int = 4
    num_turns: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {', '.join(KINDS)}; got {self.kind!r}")
        for name in ("num_requests", "input_len", "output_len", "num_groups", "num_turns"):
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
    """One request: the whole prompt (completions) or this turn's user message (chat)."""

    prompt: Prompt
    max_tokens: int
    group: int | None = None


@dataclass
class Session:
    """Requests sent one after another: one for completions, one per turn for a chat, each turn
    resending the conversation so far."""

    index: int
    turns: list[RequestSpec] = field(default_factory=list)
    chat: bool = False


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
