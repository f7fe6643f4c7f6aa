"""Server and engine options: one table feeds the command-line flags, the YAML config files and
the settings objects, so that a key in ``configs/*.yaml`` is exactly a flag's name.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags given on the command line.
Unknown keys in a file are rejected, naming the known ones. Flag names follow vLLM's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.engine import (
    ACTIVATION_PRECISIONS,
    ATTENTION_BACKENDS,
    CPU_PROBES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    TASK_SPELLINGS,
    TASKS,
    EngineConfig,
    kv_cache_dtype_name,
    parse_bytes,
)
from engine.config.json_object import json_text
from engine.config.kv_disk import WRITE_POLICIES as DISK_WRITE_POLICIES
from server.media.limits import MediaSettings, parse_limit_mm
from server.reasoning.formats import FORMATS as REASONING_FORMATS
from server.tools.formats import PARSER_NAMES as TOOL_CALL_PARSERS

MIB = 2**20


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs besides the engine.

    Limits against hostile or careless clients: ``max_request_body_size`` (bytes, or "32MiB")
    answers 413 above it; ``limit_concurrency`` (connections + requests in flight; None = no
    limit) answers 503 above it, except on /health and /metrics (server/overload.py);
    ``header_timeout`` / ``body_timeout`` (seconds; 0 = none) close a connection whose request
    headers / body do not arrive in time; ``max_connections_per_client`` (None = no cap) caps
    one client address's open connections (server/connections.py); ``stream_timeout`` (seconds; 0 = none) ends a
    streaming response whose client stops reading for that long, aborting its engine request.
    ``trust_request_chat_template`` lets requests bring their own chat template (vLLM's flag).
    ``tool_call_parser`` names the tool-call format (None: chosen from the chat template);
    ``reasoning_parser`` the reasoning format (server/reasoning; None: chosen from the chat
    template, "none": off); ``reasoning_budget`` the thought's tokens before its closing marker
    is forced (-1: unbounded; a request's ``thinking_token_budget`` overrides it);
    ``default_chat_template_kwargs`` are the template variables a
    request's own ``chat_template_kwargs`` start from (e.g. ``{"enable_thinking": false}``);
    ``enable_auto_tool_choice`` off refuses ``tool_choice: auto`` (vLLM's flag; on by default).
    ``responses_store_max_items`` / ``responses_store_max_bytes`` bound the Responses API's
    in-memory store (least recently used first out; 0 items: nothing is stored).
    ``kv_page`` serves the live KV page (``/kv``, ``/kv/state``, ``/kv/events``: server/kv_page/);
    ``profiler_dir`` enables ``/start_profile`` and ``/stop_profile`` (server/profile_routes.py);
    a session stops by itself after ``profiler_max_seconds`` or ``profiler_max_iters`` engine
    steps (0: no such cap; why the defaults: engine/profiling.py).
    ``allow_runtime_lora_updating`` mounts the LoRA load/unload routes
    (server/lora_routes.py; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    Images in requests (server/media): ``allowed_local_media_path`` (directories ``file://``
    URLs may read under), ``allowed_media_domains`` (hosts ``http(s)://`` image URLs may be
    fetched from) and ``limit_mm_per_prompt`` (``{"image": N}``, JSON text or a mapping: images
    per request), validated together as ``media_settings()``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    shutdown_timeout: float = 30.0
    disable_log_requests: bool = False
    max_request_body_size: int | str = 32 * MIB
    limit_concurrency: int | None = 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections_per_client: int | None = 256
    stream_timeout: float = 60.0
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict[str, Any] | str | None = None
    reasoning_budget: int = -1
    enable_auto_tool_choice: bool = True
    responses_store_max_items: int = 1000
    responses_store_max_bytes: int | str = 256 * MIB
    kv_page: bool = True
    profiler_dir: str | None = None
    profiler_max_seconds: float = 30.0
    profiler_max_iters: int = 1000
    allow_runtime_lora_updating: bool = False
    allowed_local_media_path: tuple[str, ...] | list[str] | str | None = None
    allowed_media_domains: tuple[str, ...] | list[str] | str | None = None
    limit_mm_per_prompt: dict[str, Any] | str | None = None

    def media_settings(self) -> MediaSettings:
        """The image options as ``MediaSettings`` (server/media/limits.py)."""
        return MediaSettings(allowed_local_media_path=self.allowed_local_media_path or (),
                             allowed_media_domains=self.allowed_media_domains or (),
                             max_images_per_request=parse_limit_mm(self.limit_mm_per_prompt))

    def __post_init__(self) -> None:
        for name in ("allowed_local_media_path", "allowed_media_domains"):
            value = getattr(self, name)
            if isinstance(value, (str, list)):
                object.__setattr__(self, name, (value,) if isinstance(value, str)
                                   else tuple(value))
        limit = self.limit_mm_per_prompt
        if limit is not None:  # normalised to a mapping, as a config file holds it
            object.__setattr__(self, "limit_mm_per_prompt",
                               {"image": parse_limit_mm(limit)})
        self.media_settings()  # ValueError naming the option
        if self.reasoning_parser is not None and \
                self.reasoning_parser not in (*REASONING_FORMATS, "none"):
            raise ValueError(f"reasoning-parser must be one of {', '.join(REASONING_FORMATS)} "
                             f"or none; got {self.reasoning_parser!r}")
        if not isinstance(self.reasoning_budget, int) or self.reasoning_budget < -1:
            raise ValueError(f"reasoning-budget must be an integer >= -1 (-1: unbounded); got "
                             f"{self.reasoning_budget!r}")
        kwargs = self.default_chat_template_kwargs
        kwargs = json_text(kwargs, "default-chat-template-kwargs", '{"enable_thinking": false}')
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"default-chat-template-kwargs must be a JSON object; got "
                             f"{kwargs!r}")
        object.__setattr__(self, "default_chat_template_kwargs", kwargs)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535; got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown-timeout cannot be negative; got {self.shutdown_timeout}")
        size = parse_bytes(self.max_request_body_size)
        if size is None or size < 1024:
            raise ValueError(f"max-request-body-size must be at least 1KiB; got "
                             f"{self.max_request_body_size!r}")
        object.__setattr__(self, "max_request_body_size", size)  # normalised once, as bytes
        if self.limit_concurrency is not None and self.limit_concurrency < 0:
            raise ValueError(f"limit-concurrency cannot be negative (0 or null: no limit); got "
                             f"{self.limit_concurrency}")
        if self.limit_concurrency == 0:
            object.__setattr__(self, "limit_concurrency", None)
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ValueError(f"{name.replace('_', '-')} cannot be negative (0: none); got "
                                 f"{getattr(self, name)}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 0:
            raise ValueError(f"max-connections-per-client cannot be negative (0 or null: no "
                             f"cap); got {self.max_connections_per_client}")
        if self.max_connections_per_client == 0:
            object.__setattr__(self, "max_connections_per_client", None)
        if not self.stream_timeout >= 0:  # also refuses NaN
            raise ValueError(f"stream-timeout cannot be negative (0: no timeout); got "
                             f"{self.stream_timeout}")
        if self.responses_store_max_items < 0:
            raise ValueError(f"responses-store-max-items cannot be negative (0: store nothing); "
                             f"got {self.responses_store_max_items}")
        store_bytes = parse_bytes(self.responses_store_max_bytes)
        if store_bytes is None:
            raise ValueError(f"responses-store-max-bytes must be a size such as 256MiB; got "
                             f"{self.responses_store_max_bytes!r}")
        object.__setattr__(self, "responses_store_max_bytes", store_bytes)
        if not self.profiler_max_seconds >= 0:  # also refuses NaN
            raise ValueError(f"profiler-max-seconds cannot be negative (0: no cap); got "
                             f"{self.profiler_max_seconds}")
        if self.profiler_max_iters < 0:
            raise ValueError(f"profiler-max-iters cannot be negative (0: no cap); got "
                             f"{self.profiler_max_iters}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log-level must be one of {', '.join(LOG_LEVELS)}; "
                             f"got {self.log_level!r}")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class Option:
    name: str  # flag / YAML key, without the leading dashes
    field: str  # EngineConfig or ServerSettings attribute
    target: str  # "engine" | "server"
    type: Callable[[Any], Any]
    help: str
    choices: tuple[str, ...] | None = None
    boolean: bool = False
    nullable: bool = False
    aliases: tuple[str, ...] = ()  # other spellings on the command line (llama.cpp's -c, -np)
    nargs: str | None = None  # "+": a list on the command line (vLLM's served names)
    dump: Callable[[Any], Any] | None = None  # the value as a config file holds it


def _size(value: Any) -> Any:
    return value if isinstance(value, int) else str(value)


def _task(value: Any) -> str:
    """``--task``, or vLLM's ``--runner`` / ``--convert`` values (pooling, classify)."""
    value = str(value)
    return TASK_SPELLINGS.get(value, value)


def _lora_module(value: Any) -> Any:
    """One ``--lora-modules`` entry as text: ``name=path`` or JSON (a flag), or a mapping with
    ``name`` and ``path`` (a YAML file), written as its JSON; parsed and checked by
    ``EngineConfig`` (``engine.config.lora.parse_lora_modules``)."""
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _json_object(value: Any) -> Any:
    """A JSON object given as text (a flag) or as a mapping (a YAML file): validated and
    normalised by ``EngineConfig`` (``SpeculativeConfig.from_value``)."""
    return value if isinstance(value, dict) else str(value)


ENGINE_OPTIONS = [
    Option("tokenizer", "tokenizer", "engine", str, "tokenizer path (default: the model's)",
           nullable=True),
    Option("mmproj", "mmproj", "engine", str,
           "llama.cpp's image-encoder GGUF (mmproj) of a Gemma 3 model: serve its images "
           "(an HF Gemma3ForConditionalGeneration directory needs none)", nullable=True),
    Option("chat-template", "chat_template", "engine", str,
           "chat template to use instead of the model's: a file path, the template text, or a "
           "built-in one (gemma, llama3, chatml, mistral; chosen by itself for a model that "
           "has none)", nullable=True),
    Option("served-model-name", "served_model_name", "engine", str,
           "name(s) the API accepts; the first is the one it reports (default: the model's "
           "name)", nullable=True, nargs="+"),
    Option("dtype", "dtype", "engine", str, "weights and activations dtype", choices=DTYPES),
    Option("device", "device", "engine", str, "auto, cpu, cuda or cuda:N"),
    Option("max-model-len", "max_model_len", "engine", int,
           "context length (default: the model's)", nullable=True, aliases=("-c",)),
    Option("block-size", "block_size", "engine", int, "tokens per KV block"),
    Option("kv-cache-memory", "kv_cache_memory", "engine", _size,
           "KV pool size, e.g. 512MiB or 4GiB (CUDA default: from --gpu-memory-utilization)",
           nullable=True),
    Option("gpu-memory-utilization", "gpu_memory_utilization", "engine", float,
           "fraction of GPU memory for weights + KV cache"),
    Option("swap-space", "swap_space", "engine", float, "host KV tier in GiB (0 = off)"),
    Option("max-num-seqs", "max_num_seqs", "engine", int, "sequences per step",
           aliases=("-np",)),
    Option("max-num-batched-tokens", "max_num_batched_tokens", "engine", int,
           "tokens per step"),
    Option("enable-prefix-caching", "enable_prefix_caching", "engine", bool,
           "share KV blocks between prompts with a common prefix", boolean=True),
    Option("enable-chunked-prefill", "enable_chunked_prefill", "engine", bool,
           "split long prompts across steps", boolean=True),
    Option("batch-invariant", "batch_invariant", "engine", bool,
           "CPU: greedy output independent of the batch (one kernel per linear for every row "
           "count, attention per row)", boolean=True),
    Option("preemption-mode", "preemption_mode", "engine", str,
           "what to do with a request when blocks run out", choices=PREEMPTION_MODES),
    Option("attention-backend", "attention_backend", "engine", str, "attention kernels",
           choices=ATTENTION_BACKENDS),
    Option("load-format", "load_format", "engine", str,
           "auto: read the checkpoint; dummy: random weights of config.json's shape (benchmarks)",
           choices=LOAD_FORMATS),
    Option("quantization", "quantization", "engine", str,
           "auto: keep a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights packed where a start-up "
           "probe finds that faster (float checkpoints stay float); int4/int8: quantise the "
           "weights on load (round-to-nearest, CPU); none: dequantise to --dtype (exact "
           "reference)", choices=QUANTIZATIONS),
    Option("quantization-group-size", "quantization_group_size", "engine", int,
           "input elements per scale for --quantization int4/int8 (32 or 128)"),
    Option("activation-precision", "activation_precision", "engine", str,
           "activations of the packed quantised linears of a GGUF: auto (float32 where its "
           "one-row decode measures within 25% of int8's at start, as on AVX-512; int8 "
           "elsewhere), float32 (the faithful kernels: answers like the float model; slower "
           "from 16 rows and in prefill), bf16 (AVX-512 BF16), or int8 (llama.cpp's int8 "
           "groups: faster, ~96% top-1 agreement with the float model)",
           choices=ACTIVATION_PRECISIONS),
    Option("generation-config", "generation_config", "engine", str,
           "sampling defaults for fields a request leaves out: auto (the model's "
           "generation_config.json, a GGUF's general.sampling.*, the embedded model's card), "
           "vllm (none: OpenAI's defaults) or a directory holding a generation_config.json"),
    Option("cpu-probe", "cpu_probe", "engine", str,
           "the CPU start-up probes behind --dtype auto and --quantization auto: cached (reuse "
           "this machine's measured verdict, measure once where there is none), background "
           "(as cached, but the packed kernels' settings are measured after the ready line, "
           "on idle steps, and switched in between requests), force "
           "(measure again and replace it), off (measure nothing: float32 and packed weights "
           "with default kernels) (default: background for kvserve serve, cached for "
           "kvserve generate and the Python LLM)", choices=CPU_PROBES),
    Option("kv-cache-dtype", "kv_cache_dtype", "engine", kv_cache_dtype_name,
           "KV cache storage: auto (float16 on a CPU, else the model's dtype), float32 (the "
           "exact pool of a float32 model), float16 or bfloat16 (16-bit "
           "whatever the model's dtype; llama.cpp's default f16 cache), int8 (a float16 scale "
           "per token and head), int4 (a float16 scale per group of 32, after a Hadamard "
           "rotation), fp8_e4m3 or fp8_e5m2 (a per-head scale); 8-bit halves the bytes per "
           "token of 16-bit, int4 takes 0.28x; fp8 (vLLM's spelling) is fp8_e4m3",
           choices=KV_CACHE_DTYPES),
    Option("kv-eviction", "kv_eviction", "engine", str,
           "stream past the context (StreamingLLM attention sinks), e.g. sink:4,window:1024: "
           "keep the first S and the last N tokens' KV (rounded up to whole blocks), evict "
           "the middle and re-use positions, so a generation may run past --max-model-len in "
           "bounded memory; approximate; turns prefix caching off (default: off)",
           nullable=True),
    Option("kv-disk-dir", "kv_disk_dir", "engine", str,
           "disk KV tier: keep prefix-cache blocks in checksummed segment files under DIR, "
           "across restarts and shared by the servers of one host (needs --kv-disk-size; "
           "default: off)", nullable=True),
    Option("kv-disk-size", "kv_disk_size", "engine", _size,
           "the disk KV tier's size, e.g. 20GiB (LRU eviction keeps DIR under it)",
           nullable=True),
    Option("kv-disk-write-policy", "kv_disk_write_policy", "engine", str,
           "when blocks reach the disk tier: write-through (as a request commits them; a "
           "crash loses at most the queue) or on-evict (as they leave host memory, and the "
           "rest at a clean shutdown: fewer bytes written)", choices=DISK_WRITE_POLICIES),
    Option("kv-remote-url", "kv_remote_url", "engine", str,
           "remote KV tier shared by replicas: prefix-cache blocks in a Redis or Valkey server, "
           "redis://HOST:PORT/DB (valkey://, rediss://, unix:// too; ?timeout=S&io_timeout=S"
           "&queue_blocks=N), read after the disk tier, written through; the server's "
           "maxmemory-policy allkeys-lru evicts (default: off)", nullable=True),
    Option("calculate-kv-scales", "calculate_kv_scales", "engine", bool,
           "fp8 KV: calibrate per-layer, per-head scales on a built-in text at start-up "
           "(else 1.0)", boolean=True),
    Option("enforce-eager", "enforce_eager", "engine", bool,
           "no CUDA graphs: every decode step launches its kernels one by one", boolean=True),
    Option("seed", "seed", "engine", int, "engine seed for unseeded sampling"),
    Option("num-threads", "num_threads", "engine", int,
           "CPU threads for torch (default: the cores available)", nullable=True),
    Option("max-waiting-requests", "max_waiting_requests", "engine", int,
           "SEQUENCES (n per request, len(prompts) x n per batch) allowed to wait for the "
           "scheduler: beyond it new requests get 503 + Retry-After; one request larger than "
           "it gets 400"),
    Option("max-seqs-per-request", "max_seqs_per_request", "engine", int,
           "most sequences (n, or len(prompts) x n for a batch) one request may ask for; "
           "above it: 400 (default: --max-num-seqs)", nullable=True),
    Option("task", "task", "engine", _task,
           "what the model serves: generate, embed (/v1/embeddings; rerank and score by "
           "cosine), score (a yes/no reranker: /v1/rerank, /v1/score) or auto (from the "
           "model; a generative model also serves /v1/embeddings as a demonstration); "
           "vLLM's --runner pooling / --convert embed|classify are accepted",
           choices=TASKS, aliases=("--runner", "--convert")),
    Option("scheduling-policy", "scheduling_policy", "engine", str,
           "fcfs: arrival order, a request's non-zero 'priority' is refused (400); priority: "
           "lower 'priority' values are scheduled first and preempted last",
           choices=SCHEDULING_POLICIES),
    Option("max-logprobs", "max_logprobs", "engine", int, "largest logprobs a request may ask"),
    Option("speculative-config", "speculative_config", "engine", _json_object,
           'speculative decoding as a JSON object (vLLM\'s format), e.g. \'{"method": "ngram", '
           '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; '
           '"disable_by_batch_size": N turns it off in steps with more than N decoding '
           'sequences (null: never)', nullable=True),
    Option("structured-outputs-config", "structured_outputs_config", "engine", _json_object,
           'structured outputs as a JSON object (vLLM\'s format): \'{"backend": "auto"}\' '
           "serves each constraint with the grammar library measured faster for it (xgrammar "
           "or llguidance); \"xgrammar\" or \"llguidance\" (\"guidance\") forces one; "
           "kvserve's bounds: compile_timeout (5 s of CPU), max_pending_compiles (8), mask_timeout "
           "(1 s), isolation (process)",
           nullable=True),
    Option("kv-events-config", "kv_events_config", "engine", _json_object,
           'KV cache events for cache-aware routers as a JSON object (vLLM\'s format), e.g. '
           '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
           '"tcp://*:5558", "topic": "kv"}\': BlockStored / BlockRemoved / AllBlocksCleared on '
           "a ZMQ PUB socket, medium GPU, CPU, DISK or STORAGE (the remote tier); also "
           "publisher (zmq or null), buffer_steps, hwm, max_queue_size (docs/kv-cache.md) "
           "(default: off)",
           nullable=True),
    Option("tensor-parallel-size", "tensor_parallel_size", "engine", int,
           "ranks that each hold 1/N of the weights (torch.distributed: gloo on CPUs, NCCL on "
           "GPUs); on one host kvserve spawns ranks 1..N-1 itself"),
    Option("distributed-init-method", "distributed_init_method", "engine", str,
           "where the ranks meet, tcp://NODE0_HOST:PORT, the same on every host (default: "
           "MASTER_ADDR/MASTER_PORT, else a free loopback port on one host)", nullable=True),
    Option("nnodes", "nnodes", "engine", int,
           "hosts sharing the tensor-parallel group (tensor-parallel-size / nnodes ranks each)"),
    Option("node-rank", "node_rank", "engine", int,
           "this host's index; node 0 serves HTTP, the others only run their ranks"),
    Option("distributed-timeout", "distributed_timeout", "engine", float,
           "seconds before a collective fails (a dead or hung rank stops the server)"),
    Option("enable-lora", "enable_lora", "engine", bool,
           "serve LoRA adapters beside the base model: a request's 'model' names one "
           "(--lora-modules, or loaded at run time with --allow-runtime-lora-updating)",
           boolean=True),
    Option("lora-modules", "lora_modules", "engine", _lora_module,
           "LoRA adapters loaded at start, each name=path or JSON '{\"name\": ..., \"path\": "
           "...}' (vLLM's forms; a PEFT directory or a llama.cpp LoRA .gguf); a request selects one by its name as "
           "'model' (needs --enable-lora; default: none)", nargs="+",
           dump=lambda modules: [f"{n}={p}" for n, p in modules]),
    Option("max-loras", "max_loras", "engine", int,
           "LoRA adapters held on the device at once (their slots): the adapters of one "
           "step's requests, as vLLM's max LoRAs per batch"),
    Option("max-lora-rank", "max_lora_rank", "engine", int,
           "the highest rank of an adapter that may be loaded"),
]
SERVER_OPTIONS = [
    Option("host", "host", "server", str, "address to listen on"),
    Option("port", "port", "server", int, "port to listen on"),
    Option("api-key", "api_key", "server", str,
           "require 'Authorization: Bearer KEY' on /v1/* (also $KVSERVE_API_KEY)",
           nullable=True),
    Option("log-level", "log_level", "server", str, "log level", choices=LOG_LEVELS),
    Option("shutdown-timeout", "shutdown_timeout", "server", float,
           "seconds to let requests in flight finish after SIGTERM"),
    Option("disable-log-requests", "disable_log_requests", "server", bool,
           "no log line per request", boolean=True),
    Option("max-request-body-size", "max_request_body_size", "server", _size,
           "largest request body, e.g. 32MiB: above it 413 (checked from Content-Length "
           "before reading, and while reading a chunked body)"),
    Option("limit-concurrency", "limit_concurrency", "server", int,
           "open connections or requests in flight beyond which requests get 503 "
           "(server_overloaded); /health and /metrics are always answered (0 or null: no "
           "limit)", nullable=True),
    Option("header-timeout", "header_timeout", "server", float,
           "seconds a connection may take to send a request's headers (from its start, or the "
           "end of the previous response); then 408 and closed, or just closed if it sent "
           "nothing (0: never)"),
    Option("body-timeout", "body_timeout", "server", float,
           "seconds a request's body may take after its headers; then 408 and closed "
           "(0: never)"),
    Option("max-connections-per-client", "max_connections_per_client", "server", int,
           "open connections one client address may hold; more get 503 "
           "(too_many_connections) and are closed. Behind a proxy every client has the "
           "proxy's address: raise it or set 0 (0 or null: no cap)", nullable=True),
    Option("stream-timeout", "stream_timeout", "server", float,
           "seconds a streaming response may wait for a client that stopped reading; then "
           "its engine request is aborted (KV blocks freed) and the response closed (0: never)"),
    Option("trust-request-chat-template", "trust_request_chat_template", "server", bool,
           "let requests bring their own chat template ('chat_template', and 'tools' / "
           "'documents' for the template): templates run on this server", boolean=True),
    Option("tool-call-parser", "tool_call_parser", "server", str,
           "the tool-call format to constrain and parse calls in: hermes (<tool_call> blocks: "
           "Hermes, Qwen2.5, Qwen3, and kvserve's default for templates without tools), "
           "llama3_json (Llama 3.1+ JSON calls), mistral ([TOOL_CALLS] calls), qwen3_coder "
           "(Qwen3-Coder's <function=...> XML calls), deepseek_v3 (DeepSeek V3 / R1 calls), "
           "deepseek_v31 (DeepSeek V3.1 calls), openai (gpt-oss's harmony channels), "
           "granite (Granite 3.x <|tool_call|>[...]) or phi4_mini_json (Phi-4-mini "
           "functools[...]) (default: chosen from the chat template, logged at start)",
           choices=TOOL_CALL_PARSERS, nullable=True),
    Option("reasoning-parser", "reasoning_parser", "server", str,
           "the reasoning format whose thought goes to reasoning_content apart from the "
           "answer: qwen3, deepseek_r1, deepseek_v3 (<think>...</think>), kimi_k2, or none "
           "(default: chosen from the chat template, logged at start)",
           choices=(*REASONING_FORMATS, "none"), nullable=True),
    Option("reasoning-budget", "reasoning_budget", "server", int,
           "tokens a reasoning model may think before its end-of-thinking marker is forced "
           "(llama.cpp's flag; a request's thinking_token_budget overrides it; -1: unbounded; "
           "default: -1)"),
    Option("default-chat-template-kwargs", "default_chat_template_kwargs", "server",
           _json_object, "template variables every chat request starts from, as a JSON "
           "object, e.g. '{\"enable_thinking\": false}'; a request's chat_template_kwargs "
           "override them", nullable=True),
    Option("kv-page", "kv_page", "server", bool,
           "serve the live KV-cache page at /kv (with /kv/state and /kv/events; behind "
           "--api-key when one is set); --no-kv-page turns it off", boolean=True),
    Option("profiler-dir", "profiler_dir", "server", str,
           "enable POST /start_profile and /stop_profile, writing torch.profiler traces "
           "(Chrome/Perfetto JSON) of the engine's steps into this directory (default: off, "
           "the routes answer 404)", nullable=True),
    Option("profiler-max-seconds", "profiler_max_seconds", "server", float,
           "a profiling session stops by itself after this many seconds; /stop_profile then "
           "reports it (0: no cap: the trace and the engine's pause at stop grow with it)"),
    Option("profiler-max-iters", "profiler_max_iters", "server", int,
           "a profiling session stops by itself after this many engine steps (vLLM's "
           "VLLM_PROFILER_MAX_ITERS; 0: no cap)"),
    Option("enable-auto-tool-choice", "enable_auto_tool_choice", "server", bool,
           "allow tool_choice 'auto' (the model chooses between text and calls; vLLM's flag, "
           "on here by default: --no-enable-auto-tool-choice refuses it)", boolean=True),
    Option("responses-store-max-items", "responses_store_max_items", "server", int,
           "the most responses the Responses API keeps in memory for previous_response_id and "
           "GET /v1/responses/{id} (least recently used out first; 0: store nothing)"),
    Option("responses-store-max-bytes", "responses_store_max_bytes", "server", _size,
           "the most bytes (as JSON) the stored responses may hold, e.g. 256MiB"),
    Option("allow-runtime-lora-updating", "allow_runtime_lora_updating", "server", bool,
           "mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; also $KVSERVE_ALLOW_RUNTIME_LORA_UPDATING): a "
           "client may then make the server read any adapter path it can see; behind "
           "--api-key when one is set (default: off, the routes answer 404)", boolean=True),
    Option("allowed-local-media-path", "allowed_local_media_path", "server", str,
           "directories whose files requests may send as file:// image URLs (symlinks and .. "
           "resolved; a file outside them is refused) (default: none, every file:// URL is "
           "refused)", nullable=True, nargs="+"),
    Option("allowed-media-domains", "allowed_media_domains", "server", str,
           "hosts that http(s):// image URLs may be fetched from (10 s timeout, same-host "
           "redirects only, at most 20MiB) (default: none, every http(s) image URL is "
           "refused: send data: URLs)", nullable=True, nargs="+"),
    Option("limit-mm-per-prompt", "limit_mm_per_prompt", "server", _json_object,
           'images one request may hold, as a JSON object (vLLM\'s format), e.g. \'{"image": '
           "4}'; more is a 400 (default: 4)", nullable=True),
]
_BY_NAME = {o.name: o for o in ENGINE_OPTIONS + SERVER_OPTIONS}
_BY_NAME["model"] = Option("model", "model", "engine", str, "model path or name",
                           nullable=True)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags (defaults suppressed, so that only flags given override a config file)."""
    _add(parser, ENGINE_OPTIONS, "engine")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    _add(parser, SERVER_OPTIONS, "server")


def _defaults(target: str) -> dict[str, Any]:
    cls = EngineConfig if target == "engine" else ServerSettings
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def _add(parser: argparse.ArgumentParser, options: Iterable[Option], title: str) -> None:
    group = parser.add_argument_group(f"{title} options")
    defaults = _defaults(title)
    for o in options:
        default = defaults.get(o.field)
        shown = ("" if default is None or "(default" in o.help else
                 f" (default: {'on' if default is True else 'off' if default is False else default})")
        kwargs: dict[str, Any] = {"dest": o.field, "default": argparse.SUPPRESS,
                                  "help": (o.help + shown).replace("%", "%%")}
        flags = [f"--{o.name}", *o.aliases]
        if o.boolean:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            group.add_argument(*flags, type=o.type, choices=o.choices, nargs=o.nargs,
                               metavar=o.name.upper().replace("-", "_") if not o.choices
                               else None, **kwargs)


def _convert(option: Option, value: Any, source: str) -> Any:
    where = f"{source}: {option.name}"
    if value is None:
        if option.nullable:
            return None
        raise ValueError(f"{where} cannot be null")
    if option.boolean:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false; got {value!r}")
        return value
    if option.nargs is not None and isinstance(value, dict):
        value = [value]  # one entry given as a mapping (a --lora-modules JSON object)
    if option.nargs is not None and isinstance(value, list):
        return [_convert(dataclasses.replace(option, nargs=None), v, source) for v in value]
    if option.type in (int, float) and isinstance(value, bool):
        raise ValueError(f"{where} must be a number; got {value!r}")
    try:
        converted = option.type(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be of type {option.type.__name__}; got {value!r}") \
            from None
    if option.type is int and isinstance(value, float) and value != converted:
        raise ValueError(f"{where} must be an integer; got {value!r}")
    if option.choices and converted not in option.choices:
        raise ValueError(f"{where} must be one of {', '.join(option.choices)}; got {value!r}")
    return converted


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML preset into ``{field: value}``; keys are flag names (``max-model-len``;
    ``max_model_len`` is accepted too)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    names = {str(k): str(k).replace("_", "-") for k in data}
    unknown = sorted(k for k, n in names.items() if n not in _BY_NAME)
    if unknown:
        raise ValueError(f"unknown key(s) in config file {path}: {', '.join(unknown)}. "
                         f"Known keys: {', '.join(sorted(_BY_NAME))}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        option = _BY_NAME[names[str(key)]]
        out[option.field] = _convert(option, value, str(path))
    return out


# `kvserve serve`'s own defaults where they differ from EngineConfig's (which the offline LLM
# keeps): the kernel settings' probe, where a machine has no verdict yet, runs after the ready
# line on idle steps (engine/weight_prep/background.py) instead of before it.
SERVE_DEFAULTS: dict[str, Any] = {"cpu_probe": "background"}


def resolve(flags: dict[str, Any], config_file: str | Path | None = None,
            defaults: dict[str, Any] | None = None) -> tuple[EngineConfig, ServerSettings]:
    """Merge defaults < ``defaults`` < file < flags into validated settings (ValueError on any
    bad value)."""
    merged: dict[str, Any] = dict(defaults or {})
    merged.update(load_config_file(config_file) if config_file else {})
    merged.update({k: v for k, v in flags.items() if k in _FIELDS})
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    server_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    engine = EngineConfig(**{k: v for k, v in merged.items() if k in engine_fields})
    server = ServerSettings(**{k: v for k, v in merged.items() if k in server_fields})
    return engine, server


_FIELDS = {o.field for o in _BY_NAME.values()}


def as_yaml_dict(engine: EngineConfig, server: ServerSettings) -> dict[str, Any]:
    """Settings as a config file would hold them (for ``--print-config`` and round trips)."""
    out: dict[str, Any] = {}
    for name, o in sorted(_BY_NAME.items()):
        src = engine if o.target == "engine" else server
        value = getattr(src, o.field)
        out[name] = (o.dump(value) if o.dump is not None else
                     value.as_dict() if hasattr(value, "as_dict") else
                     list(value) if isinstance(value, tuple) else value)
    return out
