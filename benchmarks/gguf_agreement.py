"""Teacher-forced top-1 agreement with HF transformers on tiny random GGUFs: kvserve in each
configuration next to llama.cpp's own llama-server, over the same files, in the same run.

Issue 28 asks >= 97% in kvserve's default configuration on each new architecture's GGUF. On
the tiny random models the tests build (their logits nearly tied), kvserve's default
(batch-invariant serving: prompts run on the int8-activation kernels, as llama.cpp's CPU
matmuls quantise activations to 8 bits too) lands below that while ``batch_invariant=False``
(float prefill) and ``quantization=none`` agree fully. This puts llama.cpp on the same
yardstick, so the figure says whether the gap is kvserve's or the files'; so does a column
with HF's own forward pass with its linears' inputs rounded to 8 bits per 32 (the rounding
alone, no engine). ``--trained STEPS`` trains each tiny model on the repository's docs first
(engine/loading/tiny_training.py) and measures over English text: a model whose logits are not
nearly tied. Two figures then per file and column: the tests' lighthouse paragraph
(``loadgen.teacher_forced.TEXT``, its first 200 tokens) as before, and, pooled over every
position, the ten held-out paragraphs of ``loadgen.heldout_text.HELD_OUT`` (never
training text), each its own sequence cut to the tiny configs' 256 positions less the one
generated token (the tiny vocabularies spell about a token a character: 254 positions a
paragraph).

For each file (``engine/loading/tiny_gguf_gemma.py``: Gemma 2 and Gemma 3, Q4_0 projections and a
Q8_0 token table; ``engine/loading/tiny_gguf.py``: Qwen3-MoE and Mixtral, Q4_0/Q8_0 experts):
the reference is HF's forward pass over the same file (dequantised by ``gguf``), argmax at
every position of each fixed token sequence; kvserve's top-1 comes from one prefill with prompt
logprobs a sequence (one engine per configuration); llama-server's
(``benchmarks/serving.py``'s ``find_llama_server`` unless ``--llama-server``) from one request
per prefix (``n_predict`` 1, greedy, prompt as token ids, its prompt cache reusing the shared
prefix; one server per file). The JSON has a row per file: the random or lighthouse figures
(``positions``, a fraction per column, or why llama-server could not serve the file) and,
with ``--trained``, the same under ``held-out`` (``sequences``, ``positions``).

    PYTHONPATH=. python benchmarks/gguf_agreement.py [--trained 300] [--llama-server PATH]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from benchmarks.serving import find_llama_server, serving_process
from benchmarks.startup_time import isa
from engine import LLM, SamplingParams
from loadgen.serve import free_port, machine_info

MODELS = ("gemma2", "gemma3_text", "qwen3_moe", "mixtral")
CONFIGS = {  # kvserve's configurations: LLM keyword arguments
    "kvserve default": {},
    "kvserve batch_invariant=False": {"batch_invariant": False},
    "kvserve quantization=none": {"quantization": "none"},
}


def write_file(model: str, tmp: Path, trained: int = 0):
    """The GGUF, the token sequences to score and the HF model over the file's weights.
    ``trained``: so many training steps (engine/loading/tiny_training.py) from HF's own
    initialisation first, and the sequences are then ``{"lighthouse": [TEXT's ids], "held-out":
    [a paragraph's ids, ...]}``, else ``{"random": [random token ids]}``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loading.loader import load_tokenizer, resolve_model
    from loadgen.heldout_text import HELD_OUT
    from loadgen.teacher_forced import TEXT

    if model.startswith("gemma"):
        from engine.loading.tiny_gguf_gemma import SOFTCAPS, tiny_gemma_hf, write_gemma_gguf

        path = tmp / f"tiny-{model}.Q4_0.gguf"
        weights = tiny_gemma_hf(model)
        write_gemma_gguf(weights, path)
        if trained:
            weights = _trained(weights.config, path, trained)
            write_gemma_gguf(weights, path)
        config = AutoConfig.from_pretrained(tmp, gguf_file=path.name)
        if model == "gemma2":
            for key, value in SOFTCAPS.items():
                setattr(config, key, value)
        hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, config=config,
                                                  dtype=torch.float32).eval()
        vocab, first = config.vocab_size, 6
    else:
        from engine.loading.tiny_gguf import tiny_moe_model, write_moe_gguf

        path = tmp / f"tiny-{model}.gguf"
        _, hf = write_moe_gguf(path, model)
        if trained:
            _, hf = write_moe_gguf(path, model,
                                   _trained(tiny_moe_model(model).config, path, trained))
        vocab, first = hf.config.vocab_size, 3
    if trained:
        tok = load_tokenizer(resolve_model(str(path), progress=False))
        limit = hf.config.max_position_embeddings - 1  # the prompt and the one token it samples
        return path, {"lighthouse": [tok.encode(TEXT, add_special_tokens=False)[:200]],
                      "held-out": [tok.encode(p, add_special_tokens=False)[:limit]
                                   for p in HELD_OUT]}, hf
    gen = torch.Generator().manual_seed(1)
    return path, {"random": [torch.randint(first, vocab, (96,), generator=gen).tolist()]}, hf


def _trained(config, path: Path, steps: int):
    """A model of ``config`` from HF's own initialisation (seed 0), trained ``steps`` steps on
    the docs, tokenised by the tokenizer of the GGUF at ``path``."""
    from transformers import AutoModelForCausalLM

    from engine.loading.loader import load_tokenizer, resolve_model
    from engine.loading.tiny_training import docs_tokens, train

    tokens = docs_tokens(load_tokenizer(resolve_model(str(path), progress=False)))
    torch.manual_seed(0)
    return train(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokens, steps)


def hf_top1(hf, seqs: list[list[int]], int8_activations: bool = False) -> list[list[int]]:
    """HF's argmax after each prefix of each sequence; ``int8_activations``: every
    ``nn.Linear``'s input first rounded to 8 bits per 32 values as llama.cpp's Q8_0 (scale
    amax / 127), what kvserve's default and llama.cpp's CPU matmuls compute with
    (transformers' MoE experts are not ``nn.Linear`` modules: their inputs stay float)."""
    linear = torch.nn.Linear.forward

    def rounded(self, x):
        if x.shape[-1] % 32:
            return linear(self, x)
        v = x.reshape(-1, 32)
        d = v.abs().amax(-1, keepdim=True) / 127
        q = torch.where(d > 0, torch.round(v / torch.where(d > 0, d, 1)), 0)
        return linear(self, (q * d).reshape(x.shape))

    if int8_activations:
        torch.nn.Linear.forward = rounded
    try:
        with torch.no_grad():
            return [hf(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
                    for ids in seqs]
    finally:
        torch.nn.Linear.forward = linear


def kvserve_top1(path: Path, seqs: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              cpu_probe="off", **kw)
    tops = []
    for ids in seqs:  # one request at a time: no batching effects in any configuration
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=1))[0]
        tops.append([next(t for t, lp in out.prompt_logprobs[p].items() if lp.rank == 1)
                     for p in range(1, len(ids))])
    del llm
    return tops


def llamacpp_top1(binary: Path, path: Path, seqs: list[list[int]]) -> list[list[int]] | str:
    """llama-server's greedy token after each prefix of each sequence, or why it could not
    serve the file."""
    port = free_port()
    cmd = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
           "-c", "512", "-np", "1", "-t", "2"]
    try:
        with serving_process(cmd, port, path.with_suffix(".llama-server.log"), 60) as url:
            tops = []
            for ids in seqs:
                top = []
                for p in range(1, len(ids)):
                    r = httpx.post(f"{url}/completion", timeout=60, json={
                        "prompt": ids[:p], "n_predict": 1, "temperature": 0, "top_k": 1,
                        "samplers": ["top_k"], "return_tokens": True,
                        "cache_prompt": True}).json()
                    if r.get("tokens_evaluated", p) != p:
                        return (f"llama-server evaluated {r['tokens_evaluated']} prompt "
                                f"tokens, not {p}")
                    top.append(r["tokens"][0])
                tops.append(top)
            return tops
    except RuntimeError as exc:  # it exited, or never answered /health
        return str(exc)


def agreement(got: list[list[int]] | str, ref: list[list[int]]) -> float | str:
    """The fraction of all positions of all sequences where ``got`` is ``ref``'s token
    (pooled), or ``got`` itself where it is why there is no answer."""
    if isinstance(got, str):
        return got
    pairs = [(a, b) for g, r in zip(got, ref, strict=True) for a, b in zip(g, r, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="default: the one benchmarks/vs_llamacpp.sh builds")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--trained", type=int, default=0, metavar="STEPS",
                    help="train each tiny model so many steps on docs/*.md first (300: "
                         "seconds to a minute each); the sequence is then English text")
    args = ap.parse_args()
    binary = args.llama_server or find_llama_server()
    cols = [*CONFIGS, "HF, 8-bit activations", "llama-server"]
    rows, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in tqdm(MODELS, desc="models", unit="file"):
            sub = Path(tmp) / model
            sub.mkdir()
            path, sets, hf = write_file(model, sub, args.trained)
            seqs = [ids for ss in sets.values() for ids in ss]  # every set in one pass
            tops = {"reference": hf_top1(hf, seqs),
                    "HF, 8-bit activations": hf_top1(hf, seqs, int8_activations=True)}
            for name, kw in CONFIGS.items():
                tops[name] = kvserve_top1(path, seqs, **kw)
            if binary is not None and binary.is_file():
                tops["llama-server"] = llamacpp_top1(binary, path, seqs)
            row, at = {"model": model, "trained steps": args.trained}, 0
            for label, ss in sets.items():
                part = slice(at, at + len(ss))
                at += len(ss)
                ref = tops["reference"][part]
                scored = {"positions": sum(map(len, ref))}
                for c in cols:
                    if c in tops:
                        got = tops[c] if isinstance(tops[c], str) else tops[c][part]
                        scored[c] = agreement(got, ref)
                if label == "held-out":
                    row["held-out"] = {"sequences": len(ss), **scored}
                else:
                    row.update(scored)
                table.append((f"{model} {label}", scored))
            rows.append(row)
    print(f"\n| model, text (positions) | {' | '.join(cols)} |\n|---|{'---:|' * len(cols)}")
    for name, r in table:
        cells = [r.get(c, "not run") for c in cols]
        cells = [f"{c:.1%}" if isinstance(c, float) else c for c in cells]
        print(f"| {name} ({r['positions']}) | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "isa": isa(),
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
