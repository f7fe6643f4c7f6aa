"""Building an ``EngineCore``: everything it holds that is fixed at start.

``assemble(core, config)`` loads the model files, config and tokenizer, builds the runner
(its KV pools allocated, kernels compiled, CUDA graphs captured), then the scheduler (which
builds and owns the KV manager and its host tier), the disk/remote tier, KV events, the
sampler, admission limits, pooling and constrained decoding, and logs the start-up summary.
The core then only runs steps over these parts (``engine/core.py``).
"""

from __future__ import annotations

import logging

import torch

from engine.adapters import Adapters
from engine.config.engine import EngineConfig
from engine.distributed.runner_factory import build_runner
from engine.kv_cache.disk.build import build_disk_tier, staging_blocks
from engine.kv_cache.groups import describe_kv_groups
from engine.kv_cache.host.blocks import SwapCostModel
from engine.kv_cache.snapshot import KVGeometry, KVSnapshotter
from engine.kv_events.wiring import attach as attach_kv_events
from engine.kv_format.precision import kv_precision_warning
from engine.loading.generation_defaults import generation_defaults
from engine.loading.gguf_fields import release_gguf_readers
from engine.loading.gguf_quant import gguf_source
from engine.loading.loader import (
    default_generation_eos,
    load_config,
    load_tokenizer,
    resolve_model,
)
from engine.pooling.serving import served_pooling
from engine.postprocess.detokenizer import token_text_fn, tokenizer_size
from engine.runner.cpu_memory import release_freed_memory
from engine.sampling.sampler import Sampler
from engine.scheduling.admission import AdmissionLimits
from engine.scheduling.kv_setup import KVPool
from engine.scheduling.scheduler import Scheduler
from engine.spec_decode.factory import build_proposer
from engine.spec_decode.stats import SpecDecodeCounters
from engine.structured.jump_forward import JumpForward
from engine.structured.state import StructuredOutputs
from engine.vision.prompt_format import ImagePromptFormat

logger = logging.getLogger("kvserve.engine")


def assemble(core, config: EngineConfig) -> None:
    """Give ``core`` its parts for ``config`` (``EngineCore.__init__``'s whole work)."""
    core.config = config
    torch.set_num_threads(config.resolved_num_threads())
    core.files = resolve_model(config.model)
    core.hf_config = load_config(core.files)
    tokenizer_files = _tokenizer_files(config, core.files)
    core.tokenizer_path = str(tokenizer_files.path)  # GET /get_server_info
    core.tokenizer = load_tokenizer(tokenizer_files, config.chat_template)
    core.model_name = (config.served_model_names or (core.files.name,))[0]
    core.generation_defaults = generation_defaults(
        core.files.path, config.generation_config, embedded=core.files.source == "embedded")
    core.max_model_len = config.resolve_max_model_len(core.hf_config)
    # A ModelRunner, or with tensor_parallel_size > 1 rank 0's (workers spawned).
    core.runner = build_runner(config, core.hf_config, core.files, core.max_model_len)
    # "auto" resolved by the runner (16-bit on a CPU): readers see the pool's own dtype
    core.config = config = config.replace(kv_cache_dtype=core.runner.kv_cache_dtype)
    num_blocks = core.runner.allocate_kv_cache()
    if config.calculate_kv_scales:
        _calibrate_kv_scales(core)
    num_host_blocks = core.runner.allocate_host_kv_cache()  # 0: swap_space off
    if config.stored_kv_tier and num_host_blocks == 0:
        # The disk (or remote) tier loads through host memory: a staging area of one context's blocks
        # (every KV group's, for a hybrid cache).
        # (Tensor-parallel workers make the same call: engine.distributed.worker.)
        num_host_blocks = core.runner.allocate_host_kv_cache(
            staging_blocks(core.runner, config, core.max_model_len))
    core.runner.prepare_for_serving()  # kernels compiled, CUDA graphs captured
    core._block_bytes = core.runner.kv_page_bytes_per_token * config.block_size
    cost = (SwapCostModel.for_model(core.runner.arch, core.runner.device.type,
                                    core._block_bytes) if num_host_blocks else None)
    layout = core.runner.kv_layout
    pool = KVPool(num_blocks, core.max_model_len, num_host_blocks=num_host_blocks,
                  swap_cost=cost, windows=tuple(core.runner.arch.sliding_windows),
                  layout=layout)
    spec = config.speculative_config
    proposer = build_proposer(config, max_model_len=core.max_model_len,
                              vocab_size=core.runner.arch.vocab_size,
                              # hybrid: pages of one group; the draft's hold all layers
                              num_blocks=num_blocks // layout.num_groups) if spec else None
    core.jump_forward = _jump_forward(config, core.tokenizer)
    # The scheduler builds and owns the KV manager (and its host tier) and the eviction
    # policy: the core keeps read-only references for stats, snapshots and integrity
    # checks, and never allocates, frees or looks up through them.
    core.scheduler = Scheduler(config, pool, proposer, jump_forward=core.jump_forward)
    core.kv = core.scheduler.kv
    core.stream = core.scheduler.stream
    core.sliding_window = core.scheduler.sliding_window
    eviction = core.scheduler.eviction
    core.kv_snapshots = KVSnapshotter(core.kv, KVGeometry(
        core.runner.arch.num_layers, core.runner.arch.num_kv_heads, core.runner.arch.head_dim,
        str(config.kv_cache_dtype), core.runner.kv_format.row_bytes, config.block_size,
        core.max_model_len))
    core.disk = build_disk_tier(config, core) if config.stored_kv_tier else None
    if core.disk is not None:
        core.scheduler.admission_gate = core.disk.ready
        core.scheduler.after_commit = core.disk.after_step  # write-through
        core.kv_snapshots.extra_tiers.append(core.disk)  # the KV page's third tier
    # KV cache events for cache-aware routers (--kv-events-config; engine.kv_events)
    core.kv_events = (attach_kv_events(core.kv, core.disk, layout,
                                       config=config.kv_events_config)
                      if config.kv_events_config.active else None)
    core.adapters = _adapters(config, core)
    if core.adapters is not None and core.kv_events is not None:
        core.kv_events.recorder.lora_of = core.adapters.lora_of  # events carry the adapter
    core.spec_counters = SpecDecodeCounters(spec.num_speculative_tokens if spec else 0)
    core.sampler = Sampler(seed=config.seed)
    core._spec_gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    core.vocab_size = core.runner.arch.vocab_size
    # Ids a request may name: known to the model AND the tokenizer (Qwen pads the
    # embedding past the tokenizer; those ids have no text).
    core.token_id_bound = min(core.vocab_size, tokenizer_size(core.tokenizer))
    core.limits = AdmissionLimits(
        max_model_len=core.max_model_len, token_id_bound=core.token_id_bound,
        block_size=config.block_size, num_blocks=num_blocks,
        kv_layout=layout if layout.is_hybrid else None,
        swap_blocks=num_host_blocks if config.preemption_mode != "recompute" else 0,
        max_cache_tokens=(eviction.max_cache_tokens(config.block_size)
                          if eviction is not None else None))
    # Pooling requests (engine.pooling): the task resolved, the pooling rule, head ids.
    # Images (Gemma 3): the prompt's image markers, when the runner loaded an image encoder.
    vision = getattr(core.runner, "vision", None)
    core.image_format = (ImagePromptFormat.for_gemma3(core.hf_config, core.tokenizer,
                                                      vision.tokens_per_image)
                         if vision is not None else None)
    core.pooling = served_pooling(config.task, core.files.path, core.hf_config,
                                  core.model_name, core.tokenizer,
                                  core.runner.arch.hidden_size, gguf_source(core.files.path))
    logger.info("%s", core.pooling.describe())
    core.eos_token_ids = frozenset(default_generation_eos(core.files))
    core.token_text = token_text_fn(core.tokenizer)
    # Constrained decoding; requests whose grammar is still compiling wait here, outside
    # the scheduler, while the others run.
    core.structured = StructuredOutputs(core.tokenizer, core.vocab_size, core.eos_token_ids,
                                        config.structured_outputs_config)
    # Constrained rows' logits computed only at their allowed tokens, where the runner
    # can (engine/runner/logit_columns.py); off only to measure what it buys.
    core.restrict_logits_head = bool(getattr(core.runner, "restricts_logits", False))
    log_startup(core)
    release_gguf_readers()  # the parsed GGUF's fields, read by every loading step above
    if core.runner.device.type == "cpu":
        release_freed_memory()  # loading's freed buffers back to the OS


def _adapters(config: EngineConfig, core) -> Adapters | None:
    """The LoRA registry over the runner's slots, with ``config.lora_modules`` loaded (a
    file that cannot be served fails the start with its reason); None when LoRA is off."""
    weights = getattr(core.runner, "lora", None)
    if not config.enable_lora or weights is None:
        return None
    arch = core.runner.arch
    adapters = Adapters(weights, config.max_loras, config.max_lora_rank, arch.num_heads,
                        arch.num_kv_heads)
    for name, path in config.lora_modules:
        adapters.add(adapters.read(name, path))
    core.scheduler.lora = adapters.slots
    return adapters


def _calibrate_kv_scales(core) -> None:
    from engine.kv_format.calibration import CALIBRATION_TEXT

    ids = core.tokenizer.encode(CALIBRATION_TEXT)
    scales = core.runner.calibrate_kv_scales(ids)
    ks = torch.stack([k for k, _ in scales])
    if scales[0][1] is None:  # int4: per-channel key smoothing, values as they are
        logger.info("KV scales calibrated on %d tokens: int4 key smoothing %.3g..%.3g "
                    "(per layer, head and channel)", len(ids), ks.min(), ks.max())
        return
    vs = torch.stack([v for _, v in scales])
    logger.info("KV scales calibrated on %d tokens: K %.3g..%.3g, V %.3g..%.3g "
                "(per layer and head)", len(ids), ks.min(), ks.max(), vs.min(), vs.max())


def log_startup(core) -> None:
    """The start-up summary: model, dtype, device, kernels, KV pool, tiers, drafts."""
    r = core.runner
    tokens = r.num_blocks * core.config.block_size
    logger.info(
        "model %s | dtype %s | device %s | %s | "
        "max_model_len %d | "
        "KV cache (%s): %d "
        "blocks x %d tokens = %d tokens, %d bytes/token, %.2f GiB | max concurrency at "
        "max_model_len: %.2fx", core.model_name, str(r.dtype).removeprefix("torch."),
        r.device, r.describe_kernels(),
        core.max_model_len, core.config.kv_cache_dtype, r.num_blocks, core.config.block_size,
        tokens, r.kv_bytes_per_token, r.kv_pool_bytes() / 2**30,
        r.kv_layout.max_concurrency(r.num_blocks, core.config.block_size, core.max_model_len)
        if r.kv_layout.is_hybrid else tokens / core.max_model_len)
    if r.kv_layout.is_hybrid:
        logger.info("%s", describe_kv_groups(r.kv_layout, r.num_blocks, core.config.block_size,
                                             r.kv_bytes_per_token // r.arch.num_layers,
                                             core.max_model_len))
    logger.info("%s", core.generation_defaults.describe())
    # config.dtype, not torch_dtype: transformers warns that one is deprecated
    warning = kv_precision_warning(str(core.config.kv_cache_dtype), r.dtype,
                                   getattr(core.hf_config, "dtype", None))
    if warning:
        logger.warning("KV cache precision: %s", warning)
    if core.stream is not None:
        logger.info("KV eviction (streaming, approximate; prefix caching off): %s",
                    core.stream.spec.describe(core.config.block_size))
    if core.disk is not None:
        logger.info("%s", core.disk.describe())
    spec = core.config.speculative_config
    if spec is not None:
        logger.info("speculative decoding: %s", spec.describe(
            r.quant_verdict.float_above if r.quantized else None))


def _tokenizer_files(config: EngineConfig, files):
    """``tokenizer`` when given; else the model's own; a dummy-weights model directory that
    holds only ``config.json`` borrows the embedded model's tokenizer."""
    if config.tokenizer is not None:
        return resolve_model(config.tokenizer)
    if config.load_format == "dummy" and not any(
            (files.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        logger.info("%s has no tokenizer: using the embedded model's", files.path)
        return resolve_model(None)
    return files


def _jump_forward(config: EngineConfig, tokenizer) -> JumpForward | None:
    """Jump-forward drafts for constrained sequences (``structured_outputs_config``), or None
    when ``jump_forward_tokens`` is 0."""
    so = config.structured_outputs_config
    if not so.jump_forward_tokens:
        return None
    return JumpForward(lambda text: tokenizer.encode(text, add_special_tokens=False),
                       so.jump_forward_tokens, so.jump_forward_max_seqs)
