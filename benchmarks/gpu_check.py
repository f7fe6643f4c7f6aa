"""The GPU checks behind ``benchmarks/gpu_check.sh``, one sub-command per section.

    python benchmarks/gpu_check.py parity --out DIR    # fp32 greedy = HF, bf16 agreement
                                                       # (dense, Gemma 3, MoE)
    python benchmarks/gpu_check.py decode --out DIR    # 8B-shaped decode step, graphs on/off
    python benchmarks/gpu_check.py serve  --out DIR    # real server + load generator

Everything runs on models made on the spot: tiny random HF checkpoints (``engine/loading/tiny.py``)
and the 8B shape in ``configs/models/llama-3.1-8b`` with ``--load-format dummy``, so nothing is
downloaded and the 98 MB embedded GGUF is not needed. Each section writes ``DIR/<section>.json``
and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and its kernels.py would shadow
# the ``kernels`` package; put the repository root there instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MODEL_8B = ROOT / "configs" / "models" / "llama-3.1-8b"
TINY_TYPES = {"llama": {}, "mistral": {"sliding_window": 6}, "qwen2": {}, "qwen3": {},
              "gemma2": {}, "gemma3_text": {}, "qwen3_moe": {}, "mixtral": {}}


def _write(out: Path, name: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))


def _tokenizer_dir(out: Path, vocab_size: int = 128256) -> Path:
    """A word-level tokenizer whose every id decodes to text (``w<id>``), saved once: the dummy
    8B model's tokenizer. (A real model's tokenizer is not at hand offline; a byte tokenizer
    would decode most of a random model's ids to nothing, and streaming clients would then
    see no chunks to time.) Any word not in it encodes as ``w0``, one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = out / "work" / "word-tokenizer"
    if not (path / "tokenizer.json").is_file():
        vocab = {f"w{i}": i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def copy_bandwidth_gbps(gib: float = 2.0) -> float:
    """(bytes read + written) / time of a large device-to-device copy, median of 10."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times) / 1e9


# ---- parity ---------------------------------------------------------------------------------

def _workload(seed: int, n: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return prompts, [rng.randint(4, 20) for _ in range(n)]


def cmd_parity(args: argparse.Namespace) -> int:
    results, ok = [], True
    for i, (model_type, overrides) in enumerate(TINY_TYPES.items()):
        try:
            rows = _parity_one(args.out, i, model_type, overrides)
        except Exception as exc:  # one architecture failing must not hide the others' figures
            rows = [{"model": model_type, "error": f"{type(exc).__name__}: {exc}"}]
        ok &= all("error" not in r and (r["dtype"] != "float32"
                                        or r["identical_sequences"] == r["sequences"])
                  for r in rows)
        results += rows
    _write(args.out, "parity", {"ok": ok, "results": results})
    for r in results:
        print(json.dumps(r))
    print("parity:", "OK (fp32 greedy identical to HF, graphs on and off)" if ok else "FAILED")
    return 0 if ok else 1


def _parity_one(out: Path, i: int, model_type: str, overrides: dict) -> list[dict]:
    """One tiny architecture: fp32 greedy against HF's on the CPU, graphs on and off; bf16
    against HF's own bf16 forward on the GPU."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loading.hf_reference import hf_greedy
    from engine.loading.tiny import make_tiny_model_dir

    results = []
    path = make_tiny_model_dir(out / "work" / model_type, model_type, **overrides)
    prompts, lengths = _workload(i)
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    truth = [hf_greedy(hf32, p, k, "cpu") for p, k in zip(prompts, lengths)]
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton",
                  kv_cache_memory="64MiB", enforce_eager=eager, max_num_seqs=16)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        same = sum(g == t for g, t in zip(got, truth))
        results.append({"model": model_type, "dtype": "float32", "graphs": not eager,
                        "identical_sequences": same, "sequences": len(truth)})
        del llm
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    truth16 = [hf_greedy(hf16, p, k, "cuda") for p, k in zip(prompts, lengths)]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
              kv_cache_memory="64MiB", max_num_seqs=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    first = sum(g[0] == t[0] for g, t in zip(got, truth16))
    agree = sum(_common_prefix(g, t) for g, t in zip(got, truth16))
    results.append({"model": model_type, "dtype": "bfloat16 vs HF bf16 on GPU",
                    "first_token_agree": first, "sequences": len(truth16),
                    "prefix_agree_tokens": agree, "tokens": sum(lengths)})
    return results


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- decode step ------------------------------------------------------------------------------

def compiled_variants() -> int:
    """Triton kernel variants compiled in this process so far (all of kvserve's kernels)."""
    import importlib

    mods = {m: importlib.import_module(f"kvserve_kernels.{m}")
            for m in ("paged_attention", "paged_decode", "store_kv", "copy_blocks")}
    fns = [mods["paged_attention"]._paged_attention_kernel, mods["paged_decode"]._decode_kernel,
           mods["paged_decode"]._merge_kernel, mods["store_kv"]._store_kv_kernel,
           getattr(mods["copy_blocks"], "_copy_blocks_kernel", None)]
    total = 0
    for fn in fns:
        for caches in (getattr(fn, "device_caches", None) or {}).values():
            total += len(caches[0]) if isinstance(caches, tuple) else len(caches)
    return total


def _decode_steps(llm, batch: int, prompt_len: int, steps: int) -> dict:
    """Median wall time of ``steps`` pure decode steps of ``batch`` sequences at context
    ~``prompt_len`` (engine steps: model, sampler, bookkeeping)."""
    from engine import SamplingParams

    core = llm.engine
    rng = random.Random(batch)
    ids = []
    for b in range(batch):
        rid = f"d{batch}-{b}-{time.monotonic_ns()}"
        prompt = [rng.randrange(0, 128000) for _ in range(prompt_len)]
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=steps + 8,
                                                     ignore_eos=True))
        ids.append(rid)
    while any(not r.seqs[0].text_state.token_ids for r in core.requests.values()):
        core.step()
    for _ in range(3):
        core.step()
    runner = core.runner
    run_batch = runner._run_batch  # the packed forward pass inside Runner.execute
    events = []

    def timed(inp):  # device time of the model's part of the step (copy in .. logits out)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = run_batch(inp)
        b.record()
        events.append((a, b))
        return out

    times = []
    runner._run_batch = timed
    try:
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
    finally:
        runner._run_batch = run_batch
    torch.cuda.synchronize()
    model_ms = statistics.median(a.elapsed_time(b) for a, b in events)
    core.abort_request(ids)
    core.step()
    med = statistics.median(times)
    return {"batch": batch, "context": prompt_len, "step_ms": med * 1e3, "model_ms": model_ms,
            "tok_per_s": batch / med, "p90_step_ms": sorted(times)[int(0.9 * len(times))] * 1e3}


def cmd_decode(args: argparse.Namespace) -> int:
    from engine import LLM

    bw = copy_bandwidth_gbps()
    t0 = time.perf_counter()
    llm = LLM(str(MODEL_8B), load_format="dummy", tokenizer=str(_tokenizer_dir(args.out)),
              dtype="bfloat16", device="cuda", max_model_len=4096,
              max_num_seqs=max(args.batches), kv_cache_memory="24GiB")
    load_s = time.perf_counter() - t0
    runner = llm.engine.runner
    variants_after_start = compiled_variants()
    weight_bytes = runner.weight_bytes
    # Weights read once at the measured copy rate (bytes read + written per second: the
    # traffic a streaming kernel reaches); the yardstick for a decode step.
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    rows = []
    graphs = runner.graphs
    for mode in ("graphs", "eager"):
        runner.graphs = graphs if mode == "graphs" else None
        for b in args.batches:
            r = _decode_steps(llm, b, args.context, args.steps)
            r.update(mode=mode, over_floor=r["step_ms"] / floor_ms,
                     model_over_floor=r["model_ms"] / floor_ms)
            rows.append(r)
            print(f"{mode:>6} batch {b:>3}: step {r['step_ms']:6.2f} ms "
                  f"({r['over_floor']:.2f}x floor), model {r['model_ms']:6.2f} ms "
                  f"({r['model_over_floor']:.2f}x), {r['tok_per_s']:8.1f} tok/s")
    runner.graphs = graphs
    payload = {"device": torch.cuda.get_device_name(), "copy_gbps": bw,
               "weight_bytes": weight_bytes, "floor_ms": floor_ms, "load_s": load_s,
               "graphs_captured": graphs is not None and graphs.captured, "rows": rows,
               "triton_variants_after_start": variants_after_start,
               "triton_variants_after_run": compiled_variants(),
               "torch": torch.__version__}
    _write(args.out, "decode", payload)
    print(f"Triton variants compiled: {variants_after_start} at start, "
          f"{payload['triton_variants_after_run']} after the runs (equal: no compile while serving)")
    print(f"copy bandwidth {bw:,.0f} GB/s (read+write); weights {weight_bytes / 1e9:.2f} GB; "
          f"floor {floor_ms:.2f} ms/step; engine built in {load_s:.1f} s")
    return 0


# ---- serving ----------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    import urllib.request

    tok = _tokenizer_dir(args.out)
    port = args.port
    log = open(args.out / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    cmd = [sys.executable, "-m", "server.cli", "serve", str(args.model), "--load-format", "dummy",
           "--tokenizer", str(tok), "--dtype", args.dtype, "--device", args.device,
           "--max-model-len", "4096", "--max-num-seqs", "64", "--port", str(port),
           "--disable-log-requests"]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    results = {"start_s": None, "runs": []}
    try:
        while time.perf_counter() - t0 < args.start_timeout:
            if server.poll() is not None:
                raise RuntimeError(f"server exited with {server.returncode}; see server.log")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError("server did not become healthy in time; see server.log")
        results["start_s"] = time.perf_counter() - t0
        print(f"server healthy after {results['start_s']:.1f} s")
        for conc, n in args.serve_runs:
            path = args.out / "work" / f"serve_c{conc}.json"
            subprocess.run(
                [sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", url,
                 "--num-requests", str(n), "--input-len", "256", "--output-len", "128",
                 "--concurrency", str(conc), "--tokenizer", str(tok), "--no-yardstick",
                 "--no-progress", "--json", str(path)], cwd=ROOT, check=True, timeout=120)
            results["runs"].append({"concurrency": conc, "requests": n,
                                    "summary": json.loads(path.read_text())})
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        results["metrics_kv_lines"] = [m for m in metrics.splitlines()
                                       if m.startswith("kvserve:kv_cache") and "{" in m][:8]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    _write(args.out, "serve", results)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=["parity", "decode", "serve"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 16, 64])
    p.add_argument("--context", type=int, default=512, help="decode: prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="decode: timed steps per batch")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--model", type=Path, default=MODEL_8B, help="serve: config-only model dir")
    p.add_argument("--device", default="cuda", help="serve: cpu for a dry run of the script")
    p.add_argument("--dtype", default="bfloat16", help="serve: dtype")
    p.add_argument("--serve-runs", type=lambda s: [tuple(map(int, x.split("x")))
                                                  for x in s.split(",")],
                   default=[(1, 6), (16, 64), (64, 128)],
                   help="serve: CONCxREQUESTS,... (default 1x6,16x64,64x128)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py needs an NVIDIA GPU visible to torch", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    return {"parity": cmd_parity, "decode": cmd_decode, "serve": cmd_serve}[args.section](args)


if __name__ == "__main__":
    sys.exit(main())
