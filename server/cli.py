"""``kvserve``: the command line.

    kvserve serve [MODEL] [--config FILE.yaml] [--host H] [--port P] [engine flags]
    kvserve generate [MODEL] --prompt TEXT [--chat] [--max-tokens N] [sampling/engine flags]
    kvserve cache ls | kvserve cache prune [--older-than DAYS] [--all] [--dry-run]
    kvserve bench ... / kvserve kv-calc ...   (registered by server/loadgen/cli.py when present)

MODEL defaults to the embedded SmolLM2-135M-Instruct (also named ``default``: every spelling that
``engine.loading.embedded`` knows works for every subcommand). Engine flags are named as vLLM names
them; a config file holds the same keys, and flags given on the command line override it.
``generate`` runs through the offline API (``engine.LLM``), ``serve`` through ``AsyncEngine``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any

from engine import envs
from engine.cpu.omp_spin import bound_spinning
from engine.cpu.omp_spin import describe as describe_spinning
from server.config_file import (
    SERVE_DEFAULTS,
    ServerSettings,
    add_engine_arguments,
    add_server_arguments,
    as_yaml_dict,
    resolve,
)
from server.exit_status import ENGINE_DIED_EXIT_STATUS

logger = logging.getLogger("kvserve.cli")

def _settings(args: argparse.Namespace, defaults: dict | None = None):
    # resolve() keeps only the option names it knows: the subcommand's own arguments drop out.
    flags = dict(vars(args))
    given = flags.pop("model_flag", None)  # --model / -m (vLLM's, llama.cpp's spelling)
    if given is not None:
        if flags.get("model") not in (None, given):
            raise ValueError(f"two models given: {flags['model']!r} and --model {given!r}; "
                             f"give one")
        flags["model"] = given
    if flags.pop("trust_remote_code", False):
        logger.info("--trust-remote-code: nothing to trust; kvserve runs no code from a "
                    "checkpoint (its own model classes read the weights)")
    if "api_key" not in flags and envs.api_key():
        flags["api_key"] = envs.api_key()
    if "allow_runtime_lora_updating" not in flags and envs.allow_runtime_lora_updating():
        flags["allow_runtime_lora_updating"] = True  # vLLM's environment-variable gate
    return resolve(flags, getattr(args, "config", None), defaults)


def cmd_serve(args: argparse.Namespace) -> int:
    engine_config, settings = _settings(args, SERVE_DEFAULTS)
    if args.print_config:
        import yaml

        shown = as_yaml_dict(engine_config, settings)
        if shown.get("api-key"):
            shown["api-key"] = "***"
        print(yaml.safe_dump(shown, sort_keys=True), end="")
        return 0
    from server.logs import configure_logging

    configure_logging(settings.log_level)
    torchrun_worker = envs.is_torchrun_worker()
    if engine_config.tensor_parallel_size > 1 and (engine_config.node_rank > 0
                                                    or torchrun_worker):
        from engine.distributed.launcher import run_worker_node

        logger.info("tensor parallel: node %d runs its ranks only (no HTTP server)",
                    engine_config.node_rank)
        return run_worker_node(engine_config)
    from server.app import build_app, version
    from server.listen import bind_socket
    from server.logs import StartupPhases

    # The port first: a taken one fails now, not after loading the model (as vLLM does).
    sock = bind_socket(settings.host, settings.port)
    logger.info("kvserve %s: loading %s (%s)", version(),
                engine_config.model or "the embedded model", describe_spinning())
    from engine.async_engine import AsyncEngine

    with StartupPhases() as phases:
        engine = AsyncEngine(engine_config, start=False)
    logger.info("start-up: %s", phases.describe())
    app = build_app(engine, settings)
    status = run_server(app, engine, settings, sock)
    if status == ENGINE_DIED_EXIT_STATUS:
        # Drained and stopped, but a dead engine can leave native threads wedged in a failed
        # collective (a hung tensor-parallel rank): the interpreter's teardown then aborts in
        # their destructors (SIGABRT, seen 1 exit in 4) instead of returning this status.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status



def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(settings: ServerSettings) -> str | None:
    """The warning to log when the server listens beyond this machine with no API key."""
    if settings.api_key or is_loopback(settings.host):
        return None
    return (f"kvserve listens on {settings.host}:{settings.port}, which is reachable from other "
            "machines, and NO API KEY is set: anyone who can reach this port can use the model "
            "and exhaust its capacity. Set --api-key KEY (or the KVSERVE_API_KEY environment "
            "variable) to require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
            "/detokenize, or listen on 127.0.0.1 (--host).")


def uvicorn_config(app: Any, settings: ServerSettings) -> Any:
    """uvicorn's settings: h11 with kvserve's connection limits (server/connections.py, the
    app's ``state.connections``); ``--limit-concurrency`` is the app's own (server/overload.py),
    not uvicorn's, so that /health stays answerable at the limit."""
    import uvicorn

    from server.connections import protocol_class
    from server.http_framing import strict_h11_protocol

    strict = strict_h11_protocol(settings.max_request_body_size)
    tracker = getattr(getattr(app, "state", None), "connections", None)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                          log_level=settings.log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=settings.shutdown_timeout,
                          http=protocol_class(tracker, strict) if tracker is not None else strict)


def ready_line(engine: Any, settings: ServerSettings, sock: socket.socket | None = None) -> str:
    """``kvserve ready: http://HOST:PORT (model NAME, N KV blocks = T tokens, max concurrency
    C)``: logged once, when uvicorn listens (the port is the bound one: ``--port 0`` too)."""
    host = settings.host or "0.0.0.0"
    port = sock.getsockname()[1] if sock is not None else settings.port
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    core = getattr(engine, "core", None)
    name = getattr(core, "model_name", None) or getattr(engine, "model_name", None) or "?"
    detail = f"model {name}"
    try:
        stats = engine.stats()
        block_size = int(getattr(getattr(core, "config", None), "block_size", 0) or 0)
        blocks = int(stats.num_blocks_total)
        tokens = f" = {blocks * block_size} tokens" if block_size else ""
        concurrency = f"{stats.kv_cache_max_concurrency:.2f}".rstrip("0").rstrip(".")
        detail += f", {blocks} KV blocks{tokens}, max concurrency {concurrency}"
    except Exception:  # noqa: BLE001 - a core without stats (a fake): the address still counts
        pass
    return f"kvserve ready: http://{host}:{port} ({detail})"


def run_server(app: Any, engine: Any, settings: ServerSettings,
               sock: socket.socket | None = None) -> int:
    """Serve on ``sock`` (bound to ``settings.host:port`` here when not given; see
    server/listen.py) until SIGINT/SIGTERM or until the engine dies; then drain
    (server/graceful.py): refuse new work (503, also on /health), let requests in flight finish
    within ``settings.shutdown_timeout`` seconds counted once from the start of the drain, end
    those still running properly, and stop the engine.

    Returns the process exit status: 0 after a signal, ``ENGINE_DIED_EXIT_STATUS`` when the
    engine loop died (a failed forward pass): the process must end non-zero so that a
    supervisor (Docker ``--restart``, Kubernetes) starts a fresh one.
    """
    import gc

    from server.graceful import GracefulServer
    from server.listen import bind_socket

    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    warning = exposure_warning(settings)
    if warning:
        bar = "!" * 78
        logger.warning("%s\n%s\n%s", bar, warning, bar)

    class ReadyServer(GracefulServer):
        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:  # listening: connections are accepted
                logger.info("%s", ready_line(engine, settings, sock))

    server = ReadyServer(uvicorn_config(app, settings), app, engine, settings,
                         exit_watchdog=True)
    # Start-up's objects (the model's modules, the tokenizer's tables) live as long as the
    # process: frozen, the cyclic collector's scans skip them and look at per-request objects
    # only (docs/decisions.md#small-cpu-costs; vLLM freezes likewise).
    gc.collect()
    gc.freeze()
    if engine.is_healthy:  # already driven by its own thread: serve on this one
        server.run(sockets=[sock])
        return ENGINE_DIED_EXIT_STATUS if server.engine_died else 0
    # The engine steps on this (the main) thread, where OpenMP runs its parallel regions at
    # full speed (see AsyncEngine.claim_calling_thread); HTTP is served by a second thread.
    # uvicorn installs no signal handlers off the main thread, so ours forward them.
    import signal
    import threading

    engine.claim_calling_thread()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http_exit: list[Any] = []

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit as exc:  # e.g. the port is taken: uvicorn exits at start-up
            http_exit.append(exc.code)
        finally:
            engine.stop(join_timeout=0)  # however HTTP ended, the engine loop ends too

    http = threading.Thread(target=serve_http, name="kvserve-http")
    http.start()
    engine.run()  # returns once stopped (lifespan shutdown, HTTP gone) or dead
    http.join()  # a dead engine: the server's tick notices it, drains and returns
    if http_exit and http_exit[0]:
        return http_exit[0] if isinstance(http_exit[0], int) else 1
    return ENGINE_DIED_EXIT_STATUS if server.engine_died else 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation printed as it comes (no server), e.g. to try a model quickly."""
    engine_config, settings = _settings(args)
    from server.logs import configure_logging

    configure_logging("warning" if settings.log_level == "info" else settings.log_level)
    from engine.chat_template import render_chat
    from engine.llm import LLM
    from engine.params.sampling import SamplingParams

    llm = LLM.from_config(engine_config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            stop=list(args.stop or []))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text, ids = render_chat(llm.tokenizer, messages)
    else:
        text, ids = args.prompt, list(llm.tokenizer.encode(args.prompt))
    start, printed, final = time.perf_counter(), 0, None
    if not args.chat:
        print(args.prompt, end="", flush=True)
    for out in llm.stream(ids, params, prompt=text):
        piece = out.outputs[0].text
        print(piece[printed:], end="", flush=True)
        printed = len(piece)
        final = out
    print(flush=True)
    if final is not None:
        c = final.outputs[0]
        secs = time.perf_counter() - start
        print(f"[{len(ids)} prompt tokens, {len(c.token_ids)} generated, finish_reason="
              f"{c.finish_reason}, {secs:.2f}s, {len(c.token_ids) / max(secs, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible LLM server "
                                     "built around a paged KV cache.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _model_and_config(serve)
    serve.add_argument("--print-config", action="store_true",
                       help="print the resolved settings as YAML and exit")
    add_server_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate from a prompt without a server")
    _model_and_config(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed of this request's sampling (--seed seeds the engine)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--log-level", dest="log_level", default=argparse.SUPPRESS,
                     choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    cache = sub.add_parser("cache", help="list or prune the cache of converted GGUF models "
                           "($KVSERVE_CACHE_DIR, else ~/.cache/kvserve)")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    cache_sub.required = True
    ls = cache_sub.add_parser("ls", help="what the cache holds: sizes and last use")
    ls.set_defaults(func=cmd_cache_ls)
    prune = cache_sub.add_parser(
        "prune", help="remove converted models: with no option those of another kvserve "
        "version and interrupted conversions; converted again on their next use")
    prune.add_argument("--older-than", type=float, metavar="DAYS", default=None,
                       help="also those not used for DAYS days")
    prune.add_argument("--all", action="store_true", dest="prune_all",
                       help="every converted model (the kernels and probe verdicts stay)")
    prune.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    prune.set_defaults(func=cmd_cache_prune)

    _register_plugins(sub)
    return parser


def cmd_cache_ls(args: argparse.Namespace) -> int:
    from engine.cache_dir import default_cache_dir
    from engine.loading.model_cache import entries, format_listing

    root = default_cache_dir()
    print(format_listing(root, entries(root)))
    return 0


def cmd_cache_prune(args: argparse.Namespace) -> int:
    from engine.cache_dir import default_cache_dir
    from engine.loading.model_cache import human_size, prune

    root = default_cache_dir()
    if args.older_than is not None and args.older_than < 0:
        raise ValueError("--older-than takes a number of days >= 0")
    removed = prune(root, older_than_days=args.older_than, everything=args.prune_all,
                    dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for e in removed:
        print(f"{verb} {human_size(e.size):>9}  {e.kind:<11}  {e.path}")
    print(f"{verb} {len(removed)} item(s), {human_size(sum(e.size for e in removed))}, "
          f"from {root}")
    return 0


def _model_and_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS,
                   help="model directory, .gguf file or name (default: embedded SmolLM2-135M)")
    p.add_argument("--model", "-m", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as the positional MODEL (vLLM's and llama.cpp's spelling)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; a no-op (no checkpoint code is run)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="YAML file of options (keys are the flag names); flags override it")


def _register_plugins(sub: Any) -> None:
    """Subcommands living elsewhere (bench, kv-calc); absent modules are skipped."""
    try:
        from loadgen.cli import register
    except ModuleNotFoundError as exc:
        if exc.name not in ("loadgen", "loadgen.cli"):
            raise
        return
    register(sub)


def main(argv: list[str] | None = None) -> int:
    bound_spinning()  # before torch loads its OpenMP runtime (engine/cpu/omp_spin.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad settings: a usage error, not a traceback
        parser.exit(2, f"kvserve: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
