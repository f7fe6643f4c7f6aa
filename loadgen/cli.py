"""Command-line wiring for ``kvserve bench serve|offline`` and ``kvserve kv-calc``.

``register(subparsers)`` is called by server/cli.py with the ``add_subparsers()`` object of the
top-level parser. Every command sets ``func=callable(args) -> int`` (the exit status). Heavy
imports (torch, httpx, the engine) happen inside the callables so that ``kvserve --help`` stays
fast and works without the optional benchmark dependencies.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``bench`` (with ``serve`` and ``offline``) and ``kv-calc`` to a subparsers object."""
    _add_kv_calc(subparsers)
    bench = subparsers.add_parser(
        "bench", help="benchmark a server (serve) or the engine in-process (offline)",
        description="Benchmarks you can reproduce: `bench serve` drives any OpenAI-compatible "
                    "endpoint; `bench offline` runs LLM.generate next to HF transformers.")
    sub = bench.add_subparsers(dest="bench_command",
                               metavar="{serve,offline,profile,kv-onoff,utilisation,streaming}")
    sub.required = True
    _add_serve(sub)
    _add_offline(sub)
    # The seed's figures (issue 31) and --kv-eviction's quality: each module adds its own
    # parser and imports lazily.
    for name in ("profile", "kv_onoff", "utilisation", "streaming"):
        importlib.import_module(f"loadgen.{name}").add_parser(sub)


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _csv_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _add_kv_calc(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "kv-calc", help="KV-cache bytes per token, per layer and in total (with and without GQA)",
        description="KV bytes = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes x tokens. "
                    "MODEL_OR_CONFIG is a local HF model dir, a config.json, a .gguf file, the "
                    "embedded model's name, or a preset (see --list-presets).")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_OR_CONFIG",
                   help="model dir / config.json / .gguf / preset name; omitted = embedded model "
                        "(unless --layers/--heads/--head-dim describe the model)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the model's context length, else 4096)")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    p.add_argument("--dtype", "--kv-cache-dtype", dest="dtype", default="float16",
                   help="KV cache dtype: float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, int8, "
                        "int4 (int8 rows carry a 2-byte scale: head_dim + 2 bytes; int4 rows "
                        "head_dim / 2 + 2 per group of 32; default float16)")
    p.add_argument("--layers", type=int, default=None, help="override: number of layers")
    p.add_argument("--heads", type=int, default=None, help="override: attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=None, help="override: key/value heads")
    p.add_argument("--head-dim", type=int, default=None, help="override: dimension per head")
    p.add_argument("--list-presets", action="store_true", help="list the named presets and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--kv-disk-size", default=None, metavar="SIZE",
                   help="also report how many tokens a disk KV tier of SIZE (e.g. 20GiB) holds")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block, for --kv-disk-size (default 16)")
    p.set_defaults(func=_run_kv_calc)


def _run_kv_calc(args: argparse.Namespace) -> int:
    from loadgen.kv_calc import main_from_args

    return main_from_args(args)


def _add_common_workload(p: argparse.ArgumentParser, *, chat: bool) -> None:
    g = p.add_argument_group("workload")
    choices = ["random", "shared-prefix", "copy"] + (["multi-turn", "agent"] if chat else [])
    g.add_argument("--workload", choices=choices, default="random",
                   help="random prompts; K groups behind a common prefix; copy: a passage and "
                        "its beginning again, so the answer copies the prompt (input-grounded)"
                        + ("; multi-turn chat resending the conversation; agent: tool loops, "
                           "the same function tools on every turn of every conversation and "
                           "a growing history of scripted tool calls and results" if chat
                           else ""))
    g.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=64,
                   help="requests in the run (multi-turn, agent: conversations x turns) "
                        "(default 64)")
    g.add_argument("--input-len", type=int, default=280,
                   help="prompt tokens per request, excluding any shared prefix (default 280)")
    g.add_argument("--output-len", type=_csv_ints, default=[64],
                   help="output tokens per request; a comma list sweeps it (default 64)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly in [len*(1-r), len*(1+r)] (default 0: fixed)")
    g.add_argument("--prefix-len", type=_csv_ints, default=[256],
                   help="shared-prefix: tokens of the common prefix; a comma list sweeps it")
    g.add_argument("--num-groups", type=int, default=4,
                   help="shared-prefix: number of distinct prefixes (default 4)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of prompts and arrivals; the same seed sends the same prompts "
                        "(default: serve draws a fresh one so that a rerun does not hit the "
                        "server's prefix cache; offline uses 0)")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir/.gguf used to size prompts exactly; 'none' sizes them "
                        "in words; default: the embedded model's tokenizer")


def _add_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no value: stdout)")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    g.add_argument("--label", default=None, help="name of this run in tables, JSON and plots")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (kvserve, vLLM, llama.cpp, ...)",
        description="Streams requests to /v1/completions (or /v1/chat/completions) and reports "
                    "throughput, TTFT, TPOT, inter-token and end-to-end latency.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (default)")
    p.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="API used for random/shared-prefix (multi-turn always uses chat)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--openai-only", action="store_true",
                   help="send only OpenAI's own fields (no ignore_eos, no stream_options) and "
                        "count output tokens from the stream")
    p.add_argument("--prompt-token-ids", action="store_true",
                   help="send completions prompts as token-id arrays (the tokenizer's ids), so "
                        "that servers whose tokenisers differ get the same prompt tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--ttft-at", choices=["token", "first-chunk"], default="token",
                   help="token (default): TTFT at the first chunk carrying a token (its text, "
                        "or its logprob: agent requests ask for logprobs, as a tool call's text "
                        "comes only once the call is whole); first-chunk: at the stream's first "
                        "chunk, and no logprobs asked, for servers that send that chunk with the "
                        "first token and refuse logprobs with tools in a stream (llama-server)")
    _add_common_workload(p, chat=True)
    p.add_argument("--num-turns", type=int, default=4,
                   help="multi-turn, agent: turns per conversation (default 4)")
    a = p.add_argument_group("agent workload (--input-len: the user's task; --output-len: "
                             "max_tokens of every turn)")
    a.add_argument("--tools-len", type=int, default=2000,
                   help="tokens of function tools' JSON sent with every turn (default 2000)")
    a.add_argument("--tool-result-len", type=int, default=150,
                   help="tokens of each scripted tool result (default 150)")
    a.add_argument("--tool-choice", choices=["auto", "none", "required"], default="auto",
                   help="tool_choice of every turn (default auto; kvserve refuses auto when "
                        "started with --no-enable-auto-tool-choice)")
    g = p.add_argument_group("arrivals")
    g.add_argument("--concurrency", type=_csv_ints, default=None,
                   help="max requests in flight; a comma list sweeps it (default: all at once)")
    g.add_argument("--request-rate", type=_csv_floats, default=None,
                   help="Poisson arrivals at this many requests/s; a comma list sweeps it")
    g.add_argument("--warmup", type=int, default=1,
                   help="requests sent before measuring, not counted (default 1)")
    y = p.add_argument_group("efficiency yardstick")
    y.add_argument("--model-config", default=None,
                   help="model dir/config/.gguf/preset for the FLOPs count (default: the embedded "
                        "model when --model names it)")
    y.add_argument("--peak-dtype", default="auto",
                   help="dtype of the matmul-peak probe: float32, bfloat16, auto (default: "
                        "bfloat16 where the engine would pick it, else float32)")
    y.add_argument("--no-yardstick", action="store_true",
                   help="do not measure the matmul peak (e.g. the server is another machine)")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                   help="earlier --json results drawn as extra series in the plots")
    _add_output(p)
    p.set_defaults(func=_run_serve)


def _missing_extra(exc: ModuleNotFoundError) -> int:
    import sys

    print(f"kvserve bench needs the package {exc.name!r}: pip install 'kvserve[bench]'",
          file=sys.stderr)
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    return _run_bench("loadgen.serve", ("httpx", "tqdm"), args)


def _add_offline(sub: Any) -> None:
    p = sub.add_parser(
        "offline", help="LLM.generate throughput next to HF transformers and KV-cache-off",
        description="Runs the same prompts through kvserve's LLM.generate, HF transformers' "
                    "static-batch generate, and kvserve with the KV cache off (every step "
                    "recomputes the whole sequence) where lengths allow.")
    p.add_argument("--model", default=None, help="model dir/.gguf (default: the embedded model)")
    p.add_argument("--dtype", default="auto", help="engine and HF dtype (default auto)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra EngineConfig override, repeatable (e.g. max_num_seqs=64)")
    p.add_argument("--baselines", default="hf,recompute",
                   help="comma list among hf, recompute, none (default hf,recompute)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF static batch size (default: all prompts in one batch)")
    p.add_argument("--recompute-max-tflop", type=float, default=5.0,
                   help="skip the KV-cache-off run when it would cost more TFLOP (default 5)")
    p.add_argument("--concurrency", type=_csv_ints, default=None,
                   help="sweep the engine's max_num_seqs (throughput and TPOT vs concurrency)")
    p.add_argument("--prefix-sweep", type=_csv_ints, default=None, metavar="LENS",
                   help="TTFT vs shared-prefix length with prefix caching on and off")
    p.add_argument("--speedup-sweep", type=_csv_ints, default=None, metavar="LENS",
                   help="KV-cache speed-up over recompute at these generated lengths")
    p.add_argument("--peak-dtype", default="auto", help="dtype of the matmul-peak probe")
    _add_common_workload(p, chat=False)
    _add_output(p)
    p.set_defaults(func=_run_offline)


def _run_offline(args: argparse.Namespace) -> int:
    return _run_bench("loadgen.offline", ("httpx",), args)


def _run_bench(module: str, extras: tuple[str, ...], args: argparse.Namespace) -> int:
    """``module.main_from_args(args)``, or the install hint when an optional extra it needs
    (one of ``extras``, or matplotlib for ``--plot``) is missing."""
    try:
        main_from_args = importlib.import_module(module).main_from_args
    except ModuleNotFoundError as exc:
        if exc.name not in extras:
            raise
        return _missing_extra(exc)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError as exc:
            return _missing_extra(exc)
    return main_from_args(args)
