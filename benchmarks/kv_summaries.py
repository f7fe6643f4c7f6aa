"""Pooled summaries of evicted history (issue 32 item 2): do they land between full KV and
sinks + window at the same memory?

The question the seed's "hierarchical cache: sample or pool old K/V, keep a summary" raises,
answered before any kernel is written: StreamingLLM's teacher-forced measurement
(``kvserve bench streaming``'s text, prompt and block size), run in HF transformers' own
forward pass over a ``DynamicCache`` cut by hand, so that the summary variant needs nothing
of the engine. Every cache keeps its first ``--sink`` tokens (rounded up to a block) and its
most recent full blocks; the variants differ in what happens to a block that leaves the
window:

* ``sink+window``: it is dropped (kvserve's ``--kv-eviction sink:S,window:N``; the keys
  behind it are re-rotated to the positions they move to, as the engine's K-shift does);
* ``summary:R``: it becomes R pooled key/value vectors per KV head, mean-pooled over groups
  of ``block/R`` tokens, the keys pooled BEFORE RoPE (each key rotated back by its own
  position) and re-rotated to the summary slot's position in the cache, kept between the
  sinks and the window, and weighted in the softmax by the tokens they pool (an additive
  ``log(block/R)`` on their scores: a summary counts as the tokens it stands for). The
  summaries are capped at ``M`` slots; the oldest go first (their tokens are then dropped).
  ``summary:R,nolog`` is the same without the log-weight (an ablation).

Memory is counted in cached tokens (sinks + summary slots + window, one partial block on top
for every variant); each summary row has the same budget as the ``sink+window`` row of its
group, so "at the same memory" is exact. Positions are re-used as StreamingLLM prescribes: a
key's rotary position is its index in the kept cache.

    PYTHONPATH=. python benchmarks/kv_summaries.py                      # 1,536 tokens, budget 256 (~20 min)
    PYTHONPATH=. python benchmarks/kv_summaries.py --tokens 300 --budget 64 --configs 48:16:2  # smoke

Prints a table (perplexity of the tokens past ``--context`` and of the last ``--tail``) and
writes ``--json``. Float32 weights of the embedded model (transformers' GGUF reader).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.streaming import DEFAULT_TEXT as TEXT
from benchmarks.kv_quant import isa

PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Variant:
    """A cache policy: ``window`` tokens of recent full blocks (rounded up to blocks),
    ``slots`` summary slots (0: none), ``per_block`` vectors per evicted block, log-weighted
    unless ``nolog``."""

    window: int
    slots: int = 0
    per_block: int = 0
    nolog: bool = False

    def name(self) -> str:
        if not self.slots:
            return f"sink+window:{self.window}"
        return (f"window:{self.window}+summary:{self.per_block}x{self.slots}"
                + (",nolog" if self.nolog else ""))


@dataclass
class Row:
    variant: str
    memory_tokens: int
    ppl_past_context: float
    ppl_tail: float
    seconds: float


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """The model's own rotary table: rotate ``x [1, H, T, D]`` to (or back from) positions."""

    def __init__(self, model) -> None:
        self.rotary = model.model.rotary_emb

    def cos_sin(self, like: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(like, pos.view(1, -1))
        return cos[:, None], sin[:, None]  # [1, 1, T, D]

    def apply(self, x: torch.Tensor, pos: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        cos, sin = self.cos_sin(x, pos)
        return x * cos + sign * _rotate_half(x) * sin


def _shift(x: torch.Tensor, d: int, rope: Rope) -> torch.Tensor:
    """Keys ``x`` moved ``d`` positions earlier (``R(-d)``, the engine's K-shift)."""
    if d == 0 or x.shape[2] == 0:
        return x
    return rope.apply(x, torch.tensor([d]).expand(x.shape[2]), sign=-1.0)


def forced(model, ids: list[int], v: Variant, sink_tokens: int, block: int,
           prompt: int = PROMPT_TOKENS) -> tuple[list[float], list[int]]:
    """Log-probs of ``ids[prompt:]``, teacher-forced one token at a time through a cache kept
    by ``v`` (module docstring), and the argmax token at each of those places."""
    from transformers import DynamicCache

    rope = Rope(model)
    w_blocks = -(-v.window // block)
    group = block // v.per_block if v.slots else 0
    bias = 0.0 if v.nolog or not group else math.log(group)
    cache = DynamicCache()
    filled = 0  # summary slots in the cache, at [sink_tokens, sink_tokens + filled)
    lps: list[float] = []
    top: list[int] = []

    def record(logits: torch.Tensor, target: int) -> None:
        lps.append(float(logits.float().log_softmax(-1)[target]))
        top.append(int(logits.argmax()))

    with torch.no_grad():
        # Everything before the first eviction is the same computation for every variant.
        first = min((sink_tokens // block + w_blocks + 1) * block, len(ids))
        logits = model(input_ids=torch.tensor([ids[:first]]), past_key_values=cache,
                       use_cache=True).logits[0]
        for i in range(prompt, min(first + 1, len(ids))):
            record(logits[i - 1], ids[i])
        # token t's log-prob comes from feeding token t - 1 (the cache holds ids[:t - 1])
        for t in tqdm(range(first + 1, len(ids)), desc=v.name(), leave=False, mininterval=5):
            c = cache.get_seq_length()
            n = (c - sink_tokens - filled) // block - w_blocks
            for _ in range(max(0, n)):
                filled = _evict_one(cache, rope, sink_tokens, filled, block, v)
            c = cache.get_seq_length()
            mask = torch.zeros(1, 1, 1, c + 1)
            mask[..., sink_tokens:sink_tokens + filled] = bias
            logits = model(input_ids=torch.tensor([[ids[t - 1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[c]]), cache_position=torch.tensor([c]),
                           attention_mask=mask, use_cache=True).logits[0, -1]
            record(logits, ids[t])
    return lps, top


def _evict_one(cache, rope: Rope, sink: int, filled: int, block: int, v: Variant) -> int:
    """The oldest window block leaves: dropped, or pooled into ``v.per_block`` summary slots
    (the oldest slots going past ``v.slots``); the keys behind re-rotated to their new
    positions. Returns the summary slots now filled."""
    start = sink + filled  # the window's first token
    r = v.per_block if v.slots else 0
    drop = max(0, filled + r - v.slots)  # oldest summary slots to go
    for layer in cache.layers:
        k, val = layer.keys, layer.values
        head_k, head_v = k[:, :, :sink], val[:, :, :sink]
        summ_k = _shift(k[:, :, sink + drop:start], drop, rope)
        summ_v = val[:, :, sink + drop:start]
        blk_k, blk_v = k[:, :, start:start + block], val[:, :, start:start + block]
        if r:
            pre = rope.apply(blk_k, torch.arange(start, start + block), sign=-1.0)
            shape = (*pre.shape[:2], r, block // r, pre.shape[-1])
            new_pos = torch.arange(start - drop, start - drop + r)
            new_k = rope.apply(pre.reshape(shape).mean(3), new_pos)
            new_v = blk_v.reshape(shape).mean(3)
            summ_k = torch.cat([summ_k, new_k], dim=2)
            summ_v = torch.cat([summ_v, new_v], dim=2)
        tail_k = _shift(k[:, :, start + block:], block - r + drop, rope)
        layer.keys = torch.cat([head_k, summ_k, tail_k], dim=2)
        layer.values = torch.cat([head_v, summ_v, val[:, :, start + block:]], dim=2)
    return filled + r - drop


def _ppl(lps: list[float]) -> float:
    return math.exp(-sum(lps) / len(lps))


def _parse_config(text: str) -> list[Variant]:
    """``window:slots:per_block`` -> that summary variant and its nolog ablation when
    ``per_block`` ends in ``n`` (e.g. ``128:128:2n``)."""
    w, s, r = text.split(":")
    out = [Variant(int(w), int(s), int(r.rstrip("n")))]
    if r.endswith("n"):
        out.append(Variant(int(w), int(s), int(r.rstrip("n")), nolog=True))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1536, help="forced tokens after the prompt")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--budget", type=int, default=256,
                   help="window + summary slots, in tokens, of every evicting variant")
    p.add_argument("--configs", nargs="*",
                   default=["192:64:2", "192:64:4", "128:128:2n", "128:128:4"],
                   help="summary variants as window:slots:per_block (window + slots must be "
                        "--budget; a trailing n adds the no-log-weight ablation)")
    p.add_argument("--windows", default="192,128",
                   help="comma-separated smaller plain windows to add (less memory than the "
                        "budget: what the summaries add on top of the same window)")
    p.add_argument("--context", type=int, default=512,
                   help="perplexity of the tokens from here on (past the budget)")
    p.add_argument("--tail", type=int, default=512)
    p.add_argument("--text-file", type=Path, default=TEXT)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from engine.loading.hf_reference import load_hf
    from engine.loading.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    files = resolve_model(None)
    model = load_hf(files.path)
    tok = load_tokenizer(files)
    ids = tok.encode(args.text_file.read_text())[:args.tokens + PROMPT_TOKENS]
    sink_tokens = -(-args.sink // args.block) * args.block
    variants = [Variant(args.budget)] + [Variant(int(w)) for w in args.windows.split(",") if w]
    for c in args.configs:
        for v in _parse_config(c):
            if v.window + v.slots != args.budget or args.block % v.per_block:
                raise SystemExit(f"{c}: window + slots must be {args.budget} and per_block "
                                 f"divide {args.block}")
            variants.append(v)
    rows: list[Row] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    lps = [float(full[i - 1, ids[i]]) for i in range(PROMPT_TOKENS, len(ids))]
    rows.append(_row("full KV", len(ids), lps, args, time.perf_counter() - t0))
    for v in variants:
        t0 = time.perf_counter()
        lps, _ = forced(model, ids, v, sink_tokens, args.block)
        rows.append(_row(v.name(), sink_tokens + v.window + v.slots + args.block, lps, args,
                         time.perf_counter() - t0))
        print(_fmt(rows[-1], rows[1] if len(rows) > 1 else None), flush=True)
    print(f"\n{len(ids) - PROMPT_TOKENS} forced tokens of {args.text_file.name}, sinks "
          f"{sink_tokens}, block {args.block}, budget {args.budget} (+1 partial block); "
          f"{isa()}, {time.strftime('%F')}")
    print("| variant | cached tokens | ppl past context | vs sink+window | ppl tail |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(_fmt(r, rows[1]))
    if args.json:
        args.json.write_text(json.dumps({
            "isa": isa(), "machine": platform.machine(), "date": time.strftime("%F"),
            "tokens": args.tokens, "sink_tokens": sink_tokens, "block": args.block,
            "budget": args.budget, "text": args.text_file.name,
            "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


def _row(name: str, mem: int, lps: list[float], args, secs: float) -> Row:
    return Row(name, mem, _ppl(lps[args.context - PROMPT_TOKENS:]), _ppl(lps[-args.tail:]), secs)


def _fmt(r: Row, base: Row | None) -> str:
    rel = f"{r.ppl_past_context / base.ppl_past_context - 1:+.2%}" if base else "—"
    return (f"| {r.variant} | {r.memory_tokens} | {r.ppl_past_context:.3f} | {rel} | "
            f"{r.ppl_tail:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
