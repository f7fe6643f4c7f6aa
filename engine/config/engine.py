"""Engine configuration: one frozen, validated dataclass shared by every part of the engine.

Field names follow vLLM's engine arguments, so that users can carry their flags over.
Validation happens at construction and raises ``ValueError`` with a message a user can act on.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from engine.config.kv_events import KVEventsConfig
from engine.config.kv_eviction import KVEvictionSpec
from engine.config.lora import check_lora_options, parse_lora_modules
from engine.config.speculative import SpeculativeConfig
from engine.config.structured import StructuredOutputsConfig

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3}

DTYPES = ("auto", "float32", "bfloat16", "float16")
PREEMPTION_MODES = ("recompute", "swap", "auto")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "none", "int4", "int8")
QUANTIZATION_GROUP_SIZES = (32, 128)
# The KV pool formats (engine/kv_format/formats.py); here so that this module needs no torch.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2")
# Other spellings users bring: vLLM's "fp8" is e4m3.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
SCHEDULING_POLICIES = ("fcfs", "priority")
CPU_PROBES = ("cached", "background", "force", "off")
# The packed linears' activations (engine/quantization/activation.py): auto (float32 where
# measured within its margin of int8, else int8), bf16, float32, int8 (llama.cpp's groups).
ACTIVATION_PRECISIONS = ("auto", "bf16", "float32", "int8")
# What the model is served for (engine.pooling; docs/embeddings.md). vLLM's spellings map
# onto them: --runner pooling / --convert embed -> "embed", --convert classify -> "score".
TASKS = ("auto", "generate", "embed", "score")
TASK_SPELLINGS = {"pooling": "embed", "classify": "score", "reward": "score"}


def kv_cache_dtype_name(value: str) -> str:
    """``value`` in kvserve's spelling (``fp8`` -> ``fp8_e4m3``); other names unchanged."""
    return KV_CACHE_DTYPE_ALIASES.get(str(value), str(value))


def parse_bytes(value: int | float | str | None) -> int | None:
    """Parse ``4GiB``, ``512MiB``, ``1e9`` or an integer number of bytes; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a size: use bytes or a number with a unit such as 4GiB, 512MiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine. Frozen: build a new one with :meth:`replace`.

    ``model=None`` (or "default", or any name ``engine.loading.embedded`` knows) selects the
    embedded default model (SmolLM2-135M-Instruct).
    ``kv_cache_memory`` sizes the KV pool in bytes (or "4GiB"); when ``None`` the CPU default is
    a share of the available memory within a floor and a ceiling
    (``engine.runner.cpu_memory``) and CUDA uses ``gpu_memory_utilization`` after a profiling
    pass.
    ``max_model_len=None`` takes the model's own context length.
    ``load_format="dummy"`` gives random weights of the model's shape (only ``config.json`` is
    read; the tokenizer is the model directory's, else ``tokenizer``, else the embedded
    model's). ``enforce_eager`` turns CUDA graphs off. ``speculative_config`` (vLLM's JSON
    object, e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``) turns speculative
    decoding on; see ``engine.spec_decode``.
    ``kv_cache_dtype`` stores K/V in 16 bits on a CPU and at the model's dtype elsewhere
    ("auto"), at float32 ("float32", the exact pool of a float32 model), in 16 bits ("float16",
    llama.cpp's default cache, or "bfloat16": half a float32 model's bytes) or 8-bit ("int8": a
    float16 scale per token and KV head; "fp8_e4m3"/"fp8_e5m2": a per-layer, per-head scale, 1.0 unless
    ``calculate_kv_scales`` calibrates it at start-up) or 4-bit ("int4": a float16 scale per
    group of 32 of each token's KV head, two values a byte); see ``engine/kv_format/formats.py``.
    ``kv_eviction="sink:S,window:N"`` streams past the context (StreamingLLM): the first S and
    the last N tokens' KV are kept, block-aligned, positions re-used; approximate. It turns
    prefix caching off; see ``engine/kv_cache/streaming.py``.

    ``quantization``: ``auto`` keeps a GGUF's quantised tensors packed where a start-up probe
    measures that faster (a float checkpoint stays float); ``int4`` / ``int8`` quantise the
    weights on load (round-to-nearest in groups of ``quantization_group_size``, 32 or 128;
    CPU, float32 activations); ``none`` dequantises to ``dtype`` (the exact reference path).
    ``batch_invariant`` (CPU): each row's arithmetic does not depend on the other rows of its
    step (one kernel per linear for every row count, attention per row), so greedy output is
    the same alone, batched, chunked, after a prefix hit or a preemption;
    ``engine.models.batch_invariant``.

    Admission limits (a request beyond them is refused before anything is queued):
    ``max_waiting_requests`` bounds the SEQUENCES waiting to be scheduled (a request counts
    ``n``, a batch of prompts ``len(prompts) * n``): a request that does not fit right now gets
    ``QueueFullError`` (503, retry), one that could never fit gets ``ValueError`` (400).
    ``max_seqs_per_request`` caps the sequences of one request (``None``: ``max_num_seqs``;
    see :attr:`seqs_per_request_cap`). ``scheduling_policy`` is ``"fcfs"`` (arrival order; a
    non-zero request ``priority`` is refused) or ``"priority"`` (lower value first, and
    preempted last; vLLM's semantics).
    """

    model: str | None = None
    tokenizer: str | None = None
    # --chat-template: a file, a built-in's name or the text (engine/loading/builtin_templates.py)
    chat_template: str | None = None
    # --mmproj: llama.cpp's image-encoder GGUF for a Gemma 3 model (engine/vision/mmproj.py)
    mmproj: str | None = None
    # the name the API reports, or several (vLLM's list): the first is reported, all accepted
    served_model_name: str | tuple[str, ...] | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 0.0
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str = "auto"
    quantization_group_size: int = 32
    # Packed linears' activations: "auto" (the faithful kernels' float32 activations where
    # measured within a margin of int8's decode, else int8), "bf16", "float32" or "int8"
    # (llama.cpp's per-group int8 rounding; engine/quantization/activation.py).
    activation_precision: str = "auto"
    batch_invariant: bool = True
    # The CPU start-up probes (dtype=auto, quantization=auto): reuse this machine's cached
    # verdict ("cached"), measure again ("force") or measure nothing, defaults ("off");
    # "background" (kvserve serve's default): as "cached", but quantization=auto's kernel
    # settings, where not cached, are measured after start-up on idle steps
    # (engine/weight_prep/background.py).
    cpu_probe: str = "cached"
    # Sampling defaults for fields a request leaves out (vLLM's --generation-config): "auto"
    # (the model's), "vllm" (none: OpenAI's) or a directory with a generation_config.json;
    # engine/loading/generation_defaults.py.
    generation_config: str = "auto"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enforce_eager: bool = False
    seed: int = 0
    num_threads: int | None = None
    max_waiting_requests: int = 1024  # sequences (n per request), not requests
    max_seqs_per_request: int | None = None
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    # What the model serves: "generate", "embed" (pooled vectors; /v1/rerank and /v1/score by
    # cosine), "score" (a yes/no reranker's scores), or "auto" (from the model; a generative
    # model still serves /v1/embeddings as a demonstration). engine.pooling.model_config.
    task: str = "auto"
    # vLLM's speculative_config: a dict, its JSON text or a SpeculativeConfig (None: off);
    # normalised to a SpeculativeConfig (engine.config.speculative) at construction.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # vLLM's structured_outputs_config ({"backend": "auto" | "xgrammar" | "llguidance"}): a
    # dict, its JSON text or a StructuredOutputsConfig (engine.config.structured).
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None
    # vLLM's kv_events_config ({"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}): a
    # dict, its JSON text or a KVEventsConfig (engine.config.kv_events); off by default.
    kv_events_config: KVEventsConfig | dict | str | None = None
    # Tensor parallelism (engine/distributed/): ranks holding 1/N of the weights each; across
    # hosts, nnodes hosts of tensor_parallel_size / nnodes ranks each, meeting at
    # distributed_init_method (tcp://HOST:PORT; None: MASTER_ADDR/MASTER_PORT, else a free
    # loopback port on one host). Collectives fail after distributed_timeout seconds.
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    distributed_timeout: float = 60.0
    # StreamingLLM eviction, "sink:S,window:N" (None: off); engine/kv_cache/streaming.py.
    kv_eviction: str | None = None
    # The disk KV tier (engine/kv_cache/disk/): a directory and its size (bytes or "20GiB");
    # both or neither (None: off).
    kv_disk_dir: str | None = None
    kv_disk_size: int | str | None = None
    # When blocks reach the disk: "write-through" (at commit) or "on-evict" (when they leave
    # host memory, and the rest at a clean shutdown); engine/config/kv_disk.py.
    kv_disk_write_policy: str = "write-through"
    # The remote KV tier (engine/kv_cache/remote/): redis://HOST:PORT/DB of a Redis or Valkey
    # server shared by replicas, beside or instead of the disk tier (None: off).
    kv_remote_url: str | None = None
    # LoRA adapters (engine/lora/): served beside the base model, selected per request by
    # ``SamplingParams.lora_name``; ``max_loras`` of them on the device at once, ranks up to
    # ``max_lora_rank``; ``lora_modules``: (name, path) loaded at start (vLLM's forms are
    # parsed by engine/config/lora.py; adapters also load and unload at run time).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] | list | str | None = ()

    def __post_init__(self) -> None:
        self._normalise_names()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1; got {self.block_size}")
        if self.block_size > 256:
            raise ValueError(f"block_size must be at most 256; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                             f"got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space (GiB) cannot be negative; got {self.swap_space}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)};"
                             f" got {self.attention_backend!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; "
                             f"got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                             f"got {self.quantization!r}")
        self._check_quantization()
        if self.activation_precision not in ACTIVATION_PRECISIONS:
            raise ValueError(f"activation_precision must be one of "
                             f"{', '.join(ACTIVATION_PRECISIONS)}; got {self.activation_precision!r}")
        if self.cpu_probe not in CPU_PROBES:
            raise ValueError(f"cpu_probe must be one of {', '.join(CPU_PROBES)}; "
                             f"got {self.cpu_probe!r}")
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and not (self.kv_cache_dtype.startswith("fp8")
                                             or self.kv_cache_dtype == "int4"):
            raise ValueError("calculate_kv_scales calibrates fp8 KV scales or int4 key smoothing: "
                             "it needs kv_cache_dtype fp8_e4m3, fp8_e5m2 or int4; got "
                             f"{self.kv_cache_dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1; got {self.num_threads}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1; got {self.max_waiting_requests}")
        if self.max_seqs_per_request is not None and self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request must be >= 1 (or None for max_num_seqs); "
                             f"got {self.max_seqs_per_request}")
        object.__setattr__(self, "task", TASK_SPELLINGS.get(self.task, self.task))
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)} (or vLLM's pooling, "
                             f"classify); got {self.task!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)};"
                             f" got {self.scheduling_policy!r}")
        if not 0 <= self.max_logprobs <= 100:
            raise ValueError(f"max_logprobs must be in [0, 100]; got {self.max_logprobs}")
        self._check_parallel()
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_value(self.speculative_config))
        object.__setattr__(self, "structured_outputs_config",
                           StructuredOutputsConfig.from_value(self.structured_outputs_config))
        object.__setattr__(self, "kv_events_config",
                           KVEventsConfig.from_value(self.kv_events_config))
        if self.kv_eviction is not None:
            self.eviction_spec()  # the format; sizes are checked against the model at start
            if self.speculative_config is not None:
                raise ValueError("kv_eviction cannot be combined with speculative_config: "
                                 "draft rollback does not cross evicted blocks; use one")
        # Normalise the size once so that every reader sees bytes.
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        self._check_disk_tier()
        self._check_remote_tier()
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        check_lora_options(self.enable_lora, self.max_loras, self.max_lora_rank,
                           self.lora_modules, self.tensor_parallel_size,
                           self.speculative_config is not None)

    def _check_remote_tier(self) -> None:
        if self.kv_remote_url is None:
            return
        self.remote_tier_config()  # the URL's form and knobs
        if not self.enable_prefix_caching or self.kv_eviction is not None:
            raise ValueError("kv_remote_url stores prefix-cache blocks: it needs prefix caching "
                             "on and kv_eviction off")

    def remote_tier_config(self):
        """The remote tier's options (``RemoteTierConfig``), or None when it is off."""
        if self.kv_remote_url is None:
            return None
        from engine.config.kv_remote import RemoteTierConfig

        return RemoteTierConfig.from_url(str(self.kv_remote_url))

    @property
    def stored_kv_tier(self) -> bool:
        """A tier below host memory is on (disk, remote or both: one ``DiskTier`` facade)."""
        return self.kv_disk_dir is not None or self.kv_remote_url is not None

    def _check_disk_tier(self) -> None:
        if self.kv_disk_dir is None and self.kv_disk_size is None:
            return
        if self.kv_disk_dir is None or self.kv_disk_size is None:
            raise ValueError("the disk KV tier needs both kv_disk_dir and kv_disk_size "
                             "(e.g. --kv-disk-dir /var/cache/kvserve --kv-disk-size 20GiB)")
        object.__setattr__(self, "kv_disk_size", self.disk_tier_config().size_bytes)
        if not self.enable_prefix_caching or self.kv_eviction is not None:
            raise ValueError("kv_disk_dir stores prefix-cache blocks: it needs prefix caching "
                             "on and kv_eviction off")

    def disk_tier_config(self):
        """The disk tier's options (``DiskTierConfig``), or None when it is off."""
        if self.kv_disk_dir is None:
            return None
        from engine.config.kv_disk import DiskTierConfig, parse_size

        return DiskTierConfig.for_size(str(self.kv_disk_dir), parse_size(self.kv_disk_size),
                                       self.kv_disk_write_policy)

    def _normalise_names(self) -> None:
        names = self.served_model_name
        if isinstance(names, (list, tuple)):
            names = tuple(str(n) for n in names)
            if not names or not all(names):
                raise ValueError("served_model_name must hold non-empty names")
            object.__setattr__(self, "served_model_name", names[0] if len(names) == 1 else names)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every served name (empty: the model's own name serves)."""
        names = self.served_model_name
        if names is None:
            return ()
        return (names,) if isinstance(names, str) else tuple(names)

    def _check_quantization(self) -> None:
        explicit = self.quantization in ("int4", "int8")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of "
                             f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}; "
                             f"got {self.quantization_group_size}")
        if self.quantization_group_size != 32 and not explicit:
            raise ValueError(f"quantization_group_size applies to quantization int4 or int8 "
                             f"(quantise on load); got it with {self.quantization!r}")
        if explicit and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization={self.quantization} runs float32 activations; "
                             f"use dtype float32 or auto, not {self.dtype!r}")
        if explicit and self.device.startswith("cuda"):
            raise ValueError(f"quantization={self.quantization} has CPU kernels only; use "
                             f"device cpu (or quantization none on {self.device})")

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1; got {tp!r}")
        if self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size ({tp}); "
                             f"got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}; got {self.node_rank}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout (seconds) must be > 0; got "
                             f"{self.distributed_timeout}")
        if tp == 1:
            return
        if self.calculate_kv_scales:
            raise ValueError("calculate_kv_scales is not supported with tensor_parallel_size "
                             "> 1 yet (fp8 KV pools use scales of 1.0)")
        if self.kv_eviction is not None:
            raise ValueError("kv_eviction is not supported with tensor_parallel_size > 1 yet "
                             "(the kept keys' re-rotation runs on one rank's pool only)")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_overrides(cls, model: str | None = None, **overrides: Any) -> EngineConfig:
        """Build from keyword overrides, naming any unknown key in the error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        return cls(model=model, **overrides)

    @property
    def seqs_per_request_cap(self) -> int:
        """The most sequences one request may ask for (``n``; ``len(prompts) * n`` for a batch):
        ``max_seqs_per_request``, or ``max_num_seqs`` when that is ``None``. Independent of
        ``max_waiting_requests``, which a request must also not exceed."""
        if self.max_seqs_per_request is not None:
            return self.max_seqs_per_request
        return self.max_num_seqs

    def eviction_spec(self) -> KVEvictionSpec | None:
        """``kv_eviction`` parsed (None when off); ValueError for a malformed one."""
        return KVEvictionSpec.parse(self.kv_eviction) if self.kv_eviction is not None else None

    def resolve_max_model_len(self, hf_config: Any) -> int:
        """``max_model_len``, or the model's own context (``max_position_embeddings``, 2048
        when the config has none); ValueError beyond the model's positions."""
        text = getattr(hf_config, "text_config", None) or hf_config  # multimodal: its LM
        model_max = int(getattr(text, "max_position_embeddings", 0) or 0) or 2048
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len {self.max_model_len} is beyond the model's "
                             f"{model_max} positions")
        return self.max_model_len

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 1024**3)

    def resolved_num_threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - non-Linux
            return max(1, os.cpu_count() or 1)
