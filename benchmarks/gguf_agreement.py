"""Teacher-forced top-1 agreement with HF transformers on tiny random GGUFs: kvserve in each
configuration next to llama.cpp's own llama-server, over the same files, in the same run.

Issue 28 asks >= 97% in kvserve's default configuration on each new architecture's GGUF. On
the tiny random models the tests build (their logits nearly tied), kvserve's default
(batch-invariant serving: prompts run on the int8-activation kernels, as llama.cpp's CPU
matmuls quantise activations to 8 bits too) lands below that while ``batch_invariant=False``
(float prefill) and ``quantization=none`` agree fully. This puts llama.cpp on the same
yardstick, so the figure says whether the gap is kvserve's or the files'.

For each file (``tests/models/gemma_gguf.py``: Gemma 2 and Gemma 3, Q4_0 projections and a
Q8_0 token table; ``tests/models/moe_gguf.py``: Qwen3-MoE and Mixtral, Q4_0/Q8_0 experts):
the reference is HF's forward pass over the same file (dequantised by ``gguf``), argmax at
every position of a fixed token sequence; kvserve's top-1 comes from one prefill with prompt
logprobs; llama-server's (``benchmarks/serving.py``'s ``find_llama_server`` unless
``--llama-server``) from one request per prefix (``n_predict`` 1, greedy, prompt as token ids,
its prompt cache reusing the shared prefix).

    PYTHONPATH=. python benchmarks/gguf_agreement.py [--llama-server PATH] [--json OUT]
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

from bench.serve import free_port, machine_info
from benchmarks.serving import find_llama_server, serving_process
from benchmarks.startup_time import isa
from engine import LLM, SamplingParams

MODELS = ("gemma2", "gemma3_text", "qwen3_moe", "mixtral")
CONFIGS = {  # kvserve's configurations: LLM keyword arguments
    "kvserve default": {},
    "kvserve batch_invariant=False": {"batch_invariant": False},
    "kvserve quantization=none": {"quantization": "none"},
}


def write_file(model: str, tmp: Path) -> tuple[Path, list[int], list[int]]:
    """The GGUF, the token sequence and HF's argmax after each prefix."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model.startswith("gemma"):
        from tests.models.gemma_gguf import SOFTCAPS, tiny_gemma_hf, write_gemma_gguf

        path = tmp / f"tiny-{model}.Q4_0.gguf"
        write_gemma_gguf(tiny_gemma_hf(model), path)
        config = AutoConfig.from_pretrained(tmp, gguf_file=path.name)
        if model == "gemma2":
            for key, value in SOFTCAPS.items():
                setattr(config, key, value)
        hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, config=config,
                                                  dtype=torch.float32).eval()
        vocab, first = config.vocab_size, 6
    else:
        from tests.models.moe_gguf import write_moe_gguf

        path = tmp / f"tiny-{model}.gguf"
        _, hf = write_moe_gguf(path, model)
        vocab, first = hf.config.vocab_size, 3
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(first, vocab, (96,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
    return path, ids, ref


def kvserve_top1(path: Path, ids: list[int], **kw) -> list[int]:
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              cpu_probe="off", **kw)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    top = [next(t for t, lp in out.prompt_logprobs[p].items() if lp.rank == 1)
           for p in range(1, len(ids))]
    del llm
    return top


def llamacpp_top1(binary: Path, path: Path, ids: list[int]) -> list[int] | str:
    """llama-server's greedy token after each prefix, or why it could not serve the file."""
    port = free_port()
    cmd = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
           "-c", "512", "-np", "1", "-t", "2"]
    try:
        with serving_process(cmd, port, path.with_suffix(".llama-server.log"), 60) as url:
            top = []
            for p in range(1, len(ids)):
                r = httpx.post(f"{url}/completion", timeout=60, json={
                    "prompt": ids[:p], "n_predict": 1, "temperature": 0, "top_k": 1,
                    "samplers": ["top_k"], "return_tokens": True, "cache_prompt": True}).json()
                if r.get("tokens_evaluated", p) != p:
                    return (f"llama-server evaluated {r['tokens_evaluated']} prompt tokens, "
                            f"not {p}")
                top.append(r["tokens"][0])
            return top
    except RuntimeError as exc:  # it exited, or never answered /health
        return str(exc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="default: the one benchmarks/vs_llamacpp.sh builds")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    binary = args.llama_server or find_llama_server()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in tqdm(MODELS, desc="models", unit="file"):
            sub = Path(tmp) / model
            sub.mkdir()
            path, ids, ref = write_file(model, sub)
            row = {"model": model, "positions": len(ref)}
            for name, kw in CONFIGS.items():
                got = kvserve_top1(path, ids, **kw)
                row[name] = sum(a == b for a, b in zip(got, ref)) / len(ref)
            if binary is not None and binary.is_file():
                got = llamacpp_top1(binary, path, ids)
                row["llama-server"] = (got if isinstance(got, str) else
                                       sum(a == b for a, b in zip(got, ref)) / len(ref))
            rows.append(row)
    cols = [*CONFIGS, "llama-server"]
    print(f"\n| model (positions) | {' | '.join(cols)} |\n|---|{'---:|' * len(cols)}")
    for r in rows:
        cells = [r.get(c, "not run") for c in cols]
        cells = [f"{c:.1%}" if isinstance(c, float) else c for c in cells]
        print(f"| {r['model']} ({r['positions']}) | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "isa": isa(),
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
