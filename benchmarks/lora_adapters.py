"""Multi-LoRA cost on the embedded SmolLM2-135M Q4_1 file (issue 62), in one run: 16
concurrent requests over 4 adapters against the same 16 over the base model alone, on one
engine (``enable_lora``, ``max_loras`` 4, the default packed weights), rounds interleaved.

The adapters are PEFT adapters made here with ``peft`` on the HF model of the same file
(random A and B, rank ``--rank``, targets ``--targets``: all seven projections or q/v).
Figures per mix: decode TPOT (mean over requests of (last token time - first token time) /
(tokens - 1)), TTFT and wall time, the best of ``--rounds``; the ratio adapters / base is the
adapters' cost. Also: the same base mix on an engine without ``enable_lora`` (what turning
LoRA on costs the base model); the bytes a decode step reads (the base's resident weights,
and the float32 weights of the distinct adapters in the mix), whose ratio is the floor of the
TPOT ratio for a step bound by memory; and, with ``--agreement``, teacher-forced top-1
agreement with HF (+ PEFT's merged model) in float32, of the base rows and each adapter's.

    PYTHONPATH=. python benchmarks/lora_adapters.py [--rank 8] [--targets all|qv]
        [--tokens 64] [--rounds 3] [--agreement] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.startup_time import isa
from engine import LLM, SamplingParams
from engine.loading.loader import resolve_model
from loadgen.serve import machine_info

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qv": ["q_proj", "v_proj"]}
TOPICS = ["the history of tea", "how a bicycle gear works", "why the sky is blue",
          "the rules of chess", "how bread rises", "what a compiler does", "tides and the moon",
          "how bees make honey"]


def make_adapters(hf_dir: Path, out: Path, n: int, rank: int, targets: list[str],
                  std: float) -> list[tuple[str, Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = []
    for i in range(n):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=targets,
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
        path = out / f"adapter{i}"
        model.save_pretrained(path)
        made.append((f"adapter{i}", path))
    return made


def run_mix(llm: LLM, prompts: list[list[int]], loras: list[str | None],
            tokens: int) -> dict[str, float]:
    params = [SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, lora_name=name)
              for name in loras]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tpot, ttft = [], []
    for o in outs:
        m = o.metrics
        tpot.append((m.last_token_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1))
        ttft.append(m.first_token_time - m.arrival_time)
    return {"tpot_ms": 1000 * statistics.mean(tpot), "ttft_ms": 1000 * statistics.mean(ttft),
            "wall_s": wall}


def agreement(llm: LLM, hf_dir: Path, adapters: list[tuple[str, Path]],
              prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """Top-1 agreement of each adapter's rows with HF + PEFT merged (greedy HF continuation
    teacher-forced through kvserve)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.loading.hf_reference import hf_greedy
    from loadgen.teacher_forced import continuation_hits

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hits, total = continuation_hits(llm, [(p, hf_greedy(hf, p, tokens)) for p in prompts[:4]])
    out = {"base": hits / total}
    for name, path in adapters:
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, path).merge_and_unload().eval()
        pairs = [(p, hf_greedy(merged, p, tokens)) for p in prompts[:4]]
        hits, total = continuation_hits(llm, pairs, lora_name=name)
        out[name] = hits / total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument("--std", type=float, default=0.02, help="std of the random A and B")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    files = resolve_model(None, progress=False)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-lora-bench-"))
    adapters = make_adapters(files.path, tmp, args.adapters, args.rank, TARGETS[args.targets],
                             args.std)
    specs = [f"{name}={path}" for name, path in adapters]
    common = dict(kv_cache_memory="512MiB", max_model_len=2048)
    lora = LLM(None, enable_lora=True, max_loras=args.adapters,
               max_lora_rank=max(16, args.rank), lora_modules=specs, **common)
    plain = LLM(None, **common)
    tok = lora.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in detail ({i})."}],
        tokenize=False, add_generation_prompt=True)) for i in range(args.requests)]
    mixes = {
        "base, LoRA off": (plain, [None] * args.requests),
        "base, LoRA on": (lora, [None] * args.requests),
        f"{args.adapters} adapters": (lora, [adapters[i % args.adapters][0]
                                             for i in range(args.requests)]),
        "1 adapter": (lora, [adapters[0][0]] * args.requests),
    }
    for llm, loras in mixes.values():  # warm: kernels, probe caches, adapter slots
        run_mix(llm, prompts[:4], loras[:4], 4)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in mixes}
    for r in range(args.rounds):
        for name, (llm, loras) in mixes.items():
            results[name].append(run_mix(llm, prompts, loras, args.tokens))
            print(f"round {r + 1} {name:>18}: TPOT {results[name][-1]['tpot_ms']:.1f} ms",
                  flush=True)
    best = {k: min(v, key=lambda x: x["tpot_ms"]) for k, v in results.items()}
    base = best["base, LoRA on"]["tpot_ms"]
    slots = lora.engine.adapters.slots
    base_bytes = lora.engine.runner.weight_bytes
    adapter_bytes = sum(slots.adapter(i).num_bytes for i, _ in slots.loaded())
    print(f"\n# {machine_info()} ({isa()}); {args.requests} requests x {args.tokens} tokens, "
          f"rank {args.rank}, targets {args.targets}, best of {args.rounds}")
    print(f"{'mix':>18} | TPOT ms | TTFT ms | wall s | TPOT / base (LoRA on)")
    for name, b in best.items():
        print(f"{name:>18} | {b['tpot_ms']:7.1f} | {b['ttft_ms']:7.1f} | {b['wall_s']:6.2f} | "
              f"{b['tpot_ms'] / base:.2f}x")
    print(f"bytes per decode step: base weights {base_bytes / 2**20:.1f} MiB, the "
          f"{args.adapters} adapters {adapter_bytes / 2**20:.1f} MiB (float32): floor "
          f"{(base_bytes + adapter_bytes) / base_bytes:.2f}x; one adapter "
          f"{(base_bytes + adapter_bytes / args.adapters) / base_bytes:.2f}x")
    report = {"isa": isa(), "machine": machine_info(), "args": vars(args) | {"json": None},
              "best": best, "base_bytes": base_bytes, "adapter_bytes": adapter_bytes}
    if args.agreement:
        report["agreement"] = agreement(lora, files.path, adapters, prompts, 24)
        for name, a in report["agreement"].items():
            print(f"top-1 agreement with HF{'' if name == 'base' else ' + PEFT merged'}, "
                  f"{name}: {a:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
