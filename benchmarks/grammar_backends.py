"""xgrammar vs llguidance on the same JSON schemas, with the embedded model's tokenizer.

    python benchmarks/grammar_backends.py            # SmolLM2's 49,152-token vocabulary
    python benchmarks/grammar_backends.py --repeats 5

Per library and schema it measures:

* compile: building what a request's matcher starts from (xgrammar: ``compile_json_schema``
  with its cache off; llguidance: ``grammar_from_json_schema`` plus the first ``LLMatcher``,
  which is where llguidance validates and builds its lexer), median of ``--repeats``;
* mask fill: decoding a valid instance of every schema token by token (teacher-forced), the
  time to fill the next-token bitmask of every row of a batch of 1, 16 and 64 matchers (the
  schemas cycled over the rows), using each library's parallel batch call for batches > 1
  (xgrammar ``BatchGrammarMatcher``, llguidance ``fill_next_token_bitmask_par``), then
  advancing every matcher by its token. Reported per step and per row.

The engine uses the library that wins here (engine/structured/, docs/structured-outputs.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (schema, an instance written the way a model writes it: compact JSON with ", " and ": ")
SCHEMAS: list[tuple[str, dict, object]] = [
    ("tool call", {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["get_weather", "search"]},
                       "arguments": {"type": "object", "properties": {
                           "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                           "required": ["city", "unit", "days"]}},
        "required": ["name", "arguments"]},
     {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 3}}),
    ("person (nested, arrays)", {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "emails": {"type": "array", "items": {"type": "string"},
                                  "minItems": 1, "maxItems": 3},
                       "address": {"type": "object", "properties": {
                           "street": {"type": "string"}, "zip": {"type": "string",
                                                                 "pattern": "^[0-9]{5}$"}},
                           "required": ["street", "zip"]}},
        "required": ["name", "age", "emails", "address"]},
     {"name": "Ada Lovelace", "age": 36, "emails": ["ada@example.com"],
      "address": {"street": "12 St James's Square", "zip": "10001"}}),
    ("$defs + anyOf", {
        "$defs": {"item": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                       "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["items", "note"]},
     {"items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}], "note": None}),
    ("flat record (12 fields)", {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                       for i in range(12)},
        "required": [f"field_{i}" for i in range(12)]},
     {f"field_{i}": ["text", 7, True][i % 3] for i in range(12)}),
]


def cpu_isa() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), "?")
    return f"{info.get('Model name', '?').strip()}, {isa}, {info.get('CPU(s)', '?').strip()} CPUs"


def tokens_of(tokenizer, instance) -> list[int]:
    return tokenizer.encode(json.dumps(instance), add_special_tokens=False)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab_size = vocab_size
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def compile_regex(self, regex: str):
        return self.compiler.compile_regex(regex)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                      "key_separator": ": "})
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def compile_regex(self, regex: str):
        return self.ll.LLMatcher.grammar_from_regex(regex)

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def bitmask(self, rows: int):
        return self.llt.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llt.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def mask_fill(lib, compiled: list, token_lists: list[list[int]], batch: int) -> tuple[float, int]:
    """Seconds per step (median over the steps) to fill ``batch`` rows, and the steps timed."""
    rows = [i % len(compiled) for i in range(batch)]
    matchers = [lib.matcher(compiled[r]) for r in rows]
    bitmask = lib.bitmask(batch)
    steps = min(len(token_lists[r]) for r in rows)
    times = []
    for t in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        for m, r in zip(matchers, rows):
            if not lib.accept(m, token_lists[r][t]):
                raise RuntimeError(f"{lib.name} refused token {t} of schema {r}")
    return statistics.median(times), steps


# The regex of benchmarks/structured_cost.py: bounded repetition, xgrammar's slow shape.
REGEX = r"([a-z]{1,8} ){100}"
REGEX_TEXT = " ".join(("abcdefgh"[: 1 + i % 8]) for i in range(100)) + " "
REGEX_BATCH = 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args(argv)

    from engine.loading.loader import default_generation_eos, load_tokenizer, resolve_model

    files = resolve_model(None, progress=False)
    tokenizer = load_tokenizer(files)
    eos = sorted(default_generation_eos(files))[0]
    vocab = len(tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    token_lists = [tokens_of(tokenizer, inst) for _, _, inst in SCHEMAS]
    print(f"CPU: {cpu_isa()}; vocabulary {vocab}; schemas: {len(SCHEMAS)}; tokens per "
          f"instance: {[len(t) for t in token_lists]}")
    results: dict[str, dict] = {}
    for cls in (XGrammar, LLGuidance):
        import importlib.metadata as md

        t0 = time.perf_counter()
        lib = cls(tokenizer, vocab, eos)
        setup = time.perf_counter() - t0
        version = md.version(cls.name)
        compile_s = [median_time(lambda s=s, lib=lib: lib.compile(s), args.repeats)
                     for _, s, _ in SCHEMAS]
        compiled = [lib.compile(s) for _, s, _ in SCHEMAS]
        fills = {b: mask_fill(lib, compiled, token_lists, b)[0] for b in batches}
        regex = lib.compile_regex(REGEX)
        regex_tokens = tokenizer.encode(REGEX_TEXT, add_special_tokens=False)
        regex_fill, _ = mask_fill(lib, [regex], [regex_tokens], REGEX_BATCH)
        results[cls.name] = {"compile": compile_s, "fill": fills, "regex": regex_fill}
        print(f"\n{cls.name} {version}: tokenizer setup {setup * 1e3:.0f} ms")
        for (name, _, _), c in zip(SCHEMAS, compile_s):
            print(f"  compile {name:<26} {c * 1e3:8.2f} ms")
        for b, f in fills.items():
            print(f"  mask fill batch {b:>3}: {f * 1e3:8.3f} ms/step  "
                  f"({f / b * 1e6:7.1f} us/row)")
        print(f"  regex {REGEX} batch {REGEX_BATCH}: {regex_fill * 1e3:8.3f} ms/step")
    x, g = results["xgrammar"], results["llguidance"]
    print("\nratio llguidance / xgrammar (above 1: xgrammar faster)")
    print(f"  compile (sum over schemas): {sum(g['compile']) / sum(x['compile']):.2f}")
    for b in batches:
        print(f"  mask fill batch {b:>3}: {g['fill'][b] / x['fill'][b]:.2f}")
    print(f"  regex mask fill batch {REGEX_BATCH}: {g['regex'] / x['regex']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
