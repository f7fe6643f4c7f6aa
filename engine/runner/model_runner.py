"""Owns the model weights, the KV pools and the attention backend on one device.

It implements the runner seam (``engine.runner.protocol.Runner``): it receives the scheduler's
plain ``engine.step.plan.StepPlan`` and never sees a ``Sequence``, the scheduler or the KV
manager. Which blocks a sequence owns is decided there; here they are only indices into the
pools.

``execute`` runs one step: the plan's key shifts and block copies, then its chunks packed into
one flat batch (``engine.runner.batch``) and the forward pass. It returns, per chunk that
samples, its logits rows and, for prompt positions whose logprobs were asked for, their
reduced logprobs (target logprob, rank, top-k), computed ``PROMPT_LOGPROB_CHUNK`` rows of
logits at a time (``engine.step.output.StepOutput``). The KV pools are allocated once, here,
at start-up: one ``(K, V)`` pair per layer, each
``[num_blocks, block_size, kv_heads, row_width]`` of the ``kv_cache_dtype``'s storage
(``engine/kv_format/formats.py``: row_width is head_dim, or head_dim + 2 for int8's scale).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.attention.backend import get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.config.engine import EngineConfig
from engine.kv_cache.groups import KVGroupLayout, plan_kv_groups
from engine.kv_cache.host.copier import HostTierCopier
from engine.kv_cache.host.memory import allocate_host_pools
from engine.kv_format.formats import KVFormat, kv_format, resolve_kv_cache_dtype
from engine.kv_format.rope_shift import shift_block_keys
from engine.lora.batch import LoRABatch
from engine.lora.layer import attach_lora
from engine.lora.weights import LoRAWeights
from engine.models.arch import ModelArch
from engine.models.batch_invariant import make_batch_invariant
from engine.models.cpu_decode_stack import build_decode_stack
from engine.models.layer_ops import graph_layer_ops, layer_ops_for
from engine.models.registry import build_model
from engine.models.rope import RotaryEmbedding
from engine.quantization.packed_linear import PackedLinear
from engine.runner.batch import ModelInput, build_model_input
from engine.runner.cpu_memory import cpu_kv_budget
from engine.runner.cpu_pool import fault_in_head, zeroed_pool
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from engine.runner.device import resolve_device, set_device_for_thread
from engine.runner.device_input import HostToDeviceStager, to_device
from engine.runner.dtype_choice import resolve_dtype
from engine.runner.logit_columns import SampleColumns, restricted_logits
from engine.sampling.prompt_logprobs import (
    PROMPT_LOGPROB_CHUNK,
    PromptLogprobs,
    prompt_logprobs_in_chunks,
    reduce_logits,
)
from engine.step.output import StepOutput
from engine.step.plan import KeyShift, StepPlan
from engine.triton_import import import_torch_dynamo_without_triton, triton_wanted
from engine.vision.checkpoint import load_embedder
from engine.vision.embedder import ImageEmbedder
from engine.weight_prep.apply import serves_packed_gguf
from engine.weight_prep.prepare import prepare_weights

logger = logging.getLogger("kvserve.engine")



class ModelRunner:
    """One device's runner (``engine.runner.protocol.Runner``); also one rank's shard under
    tensor parallelism, driven there by ``engine.distributed``."""

    health_check_interval: float | None = None  # nothing to check on one device

    def __init__(self, config: EngineConfig, hf_config: Any, weights, max_model_len: int,
                 files_dir: Path | None = None, tp: Any = None) -> None:
        """``files_dir``: the model's (converted) directory; with ``quantization="auto"`` the
        GGUF it came from is read for packed weights; int4/int8 quantise the loaded weights.
        ``tp`` (an ``engine.models.tp_group.TPGroup``): this runner is one rank of a
        tensor-parallel group; ``weights`` are this rank's shards, the pools hold its KV heads,
        and every method that sizes or runs something is called on every rank in the same
        order (its collectives pair up)."""
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        if not triton_wanted(self.device, config.attention_backend):
            import_torch_dynamo_without_triton()  # no Triton import, no exit noise from it
        set_device_for_thread(self.device)
        # Under tensor parallelism every rank must agree without talking: no per-rank probe
        # (resolve_dtype without a config: float32 on the CPU).
        self.dtype = resolve_dtype(config.dtype, self.device, config.quantization,
                                   hf_config if tp is None else None,
                                   tp is None and self.device.type == "cpu"
                                   and serves_packed_gguf(config, files_dir),
                                   cpu_probe=config.cpu_probe)
        self.model = _build_on_device(hf_config, max_model_len, self.device, self.dtype, tp)
        self.arch: ModelArch = self.model.arch
        prepared = prepare_weights(self.model, config, weights, device=self.device,
                                   dtype=self.dtype, files_dir=files_dir, tp_rank=tp is not None)
        self.quant_verdict = prepared.verdict
        self.linear_backend = prepared.linear_backend
        self.background = prepared.background  # the kernel settings' probe, after start-up
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.invariance = None
        if config.batch_invariant and self.device.type == "cpu":  # before the decode stack
            self.invariance = make_batch_invariant(self.model, self.backend)
            if self.quant_verdict is not None and self.quant_verdict.mode == "hybrid":
                self.quant_verdict = replace(self.quant_verdict, mode="quant", float_above=None)
        elif config.batch_invariant:
            logger.info("batch_invariant covers the CPU path only: on %s a row's kernels may "
                        "still follow the batch", self.device)
        self.quantized = self.quant_verdict is not None and self.quant_verdict.mode != "float"
        what = str(self.dtype)
        if self.quantized:
            what = (f"packed quantised linears ({config.quantization})"
                    if self.quant_verdict.float_above is None else
                    f"packed quantised linears + {self.dtype} copies for batches above "
                    f"{self.quant_verdict.float_above} rows")
        logger.info("resident weights: %.1f MiB (%s)", self.weight_bytes / 2**20, what)
        # LoRA adapters' device slots (engine.lora), wrapped around the final projections
        # (before the decode stack, which adds their delta itself).
        self.lora: LoRAWeights | None = None
        if config.enable_lora:
            self.lora = attach_lora(self.model, config.max_loras, config.max_lora_rank,
                                    self.device, self.dtype)
            logger.info("LoRA: %d adapter slots of rank <= %d over %d projections (%s)",
                        config.max_loras, config.max_lora_rank, len(self.lora.shapes),
                        self.lora.kind)
        self.model.ops = layer_ops_for(self.device, self.dtype)
        if self.device.type == "cpu":
            self.model.decode_stack, why_not = build_decode_stack(self.model)
            logger.info("decode steps: %s", "one C++ layer-stack call" if why_not == ""
                        else f"Python layer loop ({why_not})")
        self.kv_cache_dtype, why = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype,
                                                          self.device.type, config.dtype)
        self.kv_format: KVFormat = kv_format(self.kv_cache_dtype, self.dtype,
                                             self.arch.head_dim)
        logger.info("KV cache dtype %s (%s)", self.kv_cache_dtype, why)
        if self.kv_format.kind == "fp8":  # per-head scales 1.0 until calibrate_kv_scales
            one = torch.ones(self.arch.num_kv_heads, device=self.device)
            for layer in self.model.layers:
                layer.kv_scales = (one, one)
        self.max_model_len = max_model_len
        # KV groups (engine.kv_cache.groups): one for a model with one attention type; a
        # hybrid model's layers share group_size pool tensors through per-group block tables.
        self.kv_layout: KVGroupLayout = plan_kv_groups(self.arch.sliding_windows)
        self._layer_group = self.kv_layout.layer_group if self.kv_layout.is_hybrid else ()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # the distinct pools
        self.num_blocks = 0
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the host KV tier
        self.num_host_blocks = 0
        self._host_copier: HostTierCopier | None = None
        self._stager = HostToDeviceStager(self.device)
        self.graphs: DecodeGraphs | None = None
        # The image encoder and its cache when the checkpoint is a vision model (Gemma 3),
        # and the attention backend attends an image's tokens both ways (the torch one).
        self.vision: ImageEmbedder | None = None
        if config.mmproj and not str(self.arch.model_type).startswith("gemma3"):
            raise ValueError(f"--mmproj gives a Gemma 3 model its images; this model is "
                             f"{self.arch.model_type!r}")
        if tp is None and self.backend.name == "torch":
            self.vision = load_embedder(hf_config, files_dir, self.device, config.mmproj)
        elif getattr(hf_config, "vision_config", None) is not None or config.mmproj:
            logger.info("images: not served (%s)", "tensor parallelism" if tp is not None
                        else f"the {self.backend.name} attention backend")

    @property
    def weight_bytes(self) -> int:
        """Resident weight bytes: parameters, buffers (quantised weights) and the float
        packed-linear copies (plain attributes of ``PackedLinear``), each tensor once."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for mod in self.model.modules():
            if isinstance(mod, PackedLinear):
                tensors += [t for t in (mod.panels, mod.onednn) if t is not None]
        seen: dict[int, int] = {}
        for t in tensors:
            key = t.data_ptr() if t.layout == torch.strided else id(t)
            seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return sum(seen.values())

    # ---- KV pool -------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's K and V take in the pools, scales included (all layers)."""
        return 2 * self.arch.num_layers * self.arch.num_kv_heads * self.kv_format.row_bytes

    @property
    def kv_page_bytes_per_token(self) -> int:
        """What one token of one pool block takes: one KV group's layers (all layers unless
        the KV cache is hybrid)."""
        return 2 * self.kv_layout.group_size * self.arch.num_kv_heads * self.kv_format.row_bytes

    def _pool_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.config.block_size, self.arch.num_kv_heads,
                self.kv_format.row_width)

    def kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        budget = cpu_kv_budget()
        logger.info("%s", budget.describe())
        return budget.budget

    def _profile_cuda_budget(self) -> int:
        """Bytes for the KV pools: profile the largest step the engine may run (a prefill of
        ``max_num_batched_tokens``, the sampler's sort over ``max_num_seqs`` rows and, when
        logprobs are allowed, one chunk of prompt logprobs — they are reduced chunk by chunk
        while the sampled rows' logits are alive), then size from the device's free memory
        and ``gpu_memory_utilization`` (``engine.runner.memory``)."""
        from engine.runner.memory import MemorySnapshot, kv_cache_budget

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.config.block_size
        tmp_blocks = -(-n // bs)
        self._allocate(tmp_blocks)
        meta = _warmup_metadata([n], bs, tmp_blocks, self.device)
        with torch.inference_mode():
            hidden = self._forward(torch.zeros(n, dtype=torch.long, device=self.device),
                                   torch.arange(n, device=self.device), meta)
            rows = min(n, self.config.max_num_seqs)
            logits = self.model.compute_logits(hidden[-rows:])
            if self.config.max_logprobs > 0:  # prompt logprobs: one chunk at a time
                chunk = min(n, PROMPT_LOGPROB_CHUNK)
                reduce_logits(self.model.compute_logits(hidden[:chunk]),
                              torch.zeros(chunk, dtype=torch.long, device=self.device),
                              self.config.max_logprobs)
            probs = torch.softmax(logits, dim=-1)  # the sampler's top-p/top-k working set
            torch.sort(probs, dim=-1, descending=True)[0].cumsum_(dim=-1)
            del logits, probs
            del hidden
        torch.cuda.synchronize(self.device)
        self.kv_caches = self._kv_slots = []
        snap = MemorySnapshot.capture(self.device)
        budget = kv_cache_budget(snap, self.config.gpu_memory_utilization)
        logger.info("GPU memory: %s", budget.describe())
        return budget.budget

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Size and allocate the pools once; returns the number of blocks. ``num_blocks``
        (a speculative draft model's pool, sized like its target's) skips the sizing."""
        bs = self.config.block_size
        if num_blocks is None:
            num_blocks = self.kv_budget_bytes() // (self.kv_page_bytes_per_token * bs)
            if self.tp is not None:  # every rank's pool has the same number of blocks
                num_blocks = self.tp.min_int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for one block of {bs} tokens "
                             f"({self.kv_page_bytes_per_token * bs} bytes)")
        self._allocate(num_blocks)
        return num_blocks

    def _allocate(self, num_blocks: int) -> None:
        shape, dtype = self._pool_shape(num_blocks), self.kv_format.storage_dtype
        # Zeroed, not empty: padded key slots are masked, but 0 * NaN garbage would still be NaN.
        slots = [(zeroed_pool(shape, dtype, self.device), zeroed_pool(shape, dtype, self.device))
                 for _ in range(self.kv_layout.group_size)]
        for pool in (t for pair in slots for t in pair):
            fault_in_head(pool)
        # Hybrid: layer i stores into its slot's tensors, through its group's block table.
        self.kv_caches = [slots[s] for s in self.kv_layout.layer_slot]
        self._kv_slots = slots
        self.num_blocks = num_blocks

    def calibrate_kv_scales(self, token_ids: Sequence[int]) -> list[tuple[torch.Tensor,
                                                                          torch.Tensor]]:
        """fp8 and int4 pools: one prefill of ``token_ids`` (cut to what one step and the pool
        hold) with every layer's K/V observed, then each layer's ``kv_scales`` set from the
        maxima (``engine.kv_format.calibration``: fp8 per-head scales; int4 per-channel key
        smoothing, the value entry None). Before serving only: it writes the first blocks
        of the pool, which no request owns yet. Returns the scales."""
        from engine.kv_format.calibration import KVAbsMax, KVChannelAbsMax

        kind = self.kv_format.kind
        if kind not in ("fp8", "int4"):
            raise ValueError(f"KV scale calibration is for fp8 and int4 pools; this one is "
                             f"{kind}")
        bs = self.config.block_size
        n = min(len(token_ids), self.config.max_num_batched_tokens, self.max_model_len,
                self.num_blocks * bs)
        if n < 1:
            raise ValueError("KV scale calibration needs at least one token")
        observer = KVAbsMax(self.arch.num_layers, self.arch.num_kv_heads, self.device) \
            if kind == "fp8" else KVChannelAbsMax(self.arch.num_layers, self.arch.num_kv_heads,
                                                  self.arch.head_dim, self.device)
        layers = list(self.model.layers)
        for layer in layers:
            layer.kv_observer, layer.kv_scales = observer, None
        try:
            meta = _warmup_metadata([n], bs, self.num_blocks, self.device)
            ids = torch.tensor(list(token_ids[:n]), dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self._forward(ids, torch.arange(n, device=self.device), meta)
        finally:
            for layer in layers:
                layer.kv_observer = None
        scales = observer.scales(self.kv_format.fp8_max) if kind == "fp8" else \
            observer.smoothing()
        for layer, kv_scales in zip(layers, scales):
            layer.kv_scales = kv_scales
        return scales

    # ---- host KV tier (swap_space) -------------------------------------------------------

    def allocate_host_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the host pools (same layout as the device pools) sized by ``swap_space``,
        or of ``num_blocks`` (the disk tier's staging area when swap_space is 0); returns the
        number of host blocks, 0 when the tier is off. Uninitialised: a host block is only
        ever read after a copy filled it."""
        block_bytes = self.kv_page_bytes_per_token * self.config.block_size
        n = self.config.swap_space_bytes // block_bytes if num_blocks is None else num_blocks
        if self.tp is not None:
            n = self.tp.min_int(n)
        if self.config.swap_space > 0 and n == 0:
            logger.warning("swap_space %.3g GiB holds no block of %d bytes: host tier off",
                           self.config.swap_space, block_bytes)
        if n == 0:
            if self.config.preemption_mode != "recompute":
                logger.warning("preemption_mode=%s needs a host tier (swap_space > 0): "
                               "preempted requests will be recomputed",
                               self.config.preemption_mode)
            return 0
        # One exact-size host buffer (not one pinned tensor per layer, which PyTorch's caching
        # host allocator rounds up to a power of two each). Unpinned: the copier moves blocks
        # through pinned staging buffers of its own (engine/kv_cache/host/copier.py).
        pools = allocate_host_pools(self.kv_layout.group_size, self._pool_shape(n),
                                    self.kv_format.storage_dtype, pin=False)
        self._host_pools = pools
        self.host_kv_caches = pools.layers  # one per pool tensor (slot): per layer unless hybrid
        self.num_host_blocks = n
        self._host_copier = HostTierCopier(self._kv_slots, self.host_kv_caches, self.device)
        logger.info("host KV tier: %d blocks, %.2f GiB", n, pools.nbytes / 2**30)
        return n

    def wait_host_copies(self) -> None:
        """Block until the host pools hold every block written back so far (CUDA defers the
        last step's write-backs; see ``HostTierCopier.wait_d2h``). No-op without a tier."""
        if self._host_copier is not None:
            self._host_copier.wait_d2h()

    def _copy_kv_blocks(self, d2h: Sequence[tuple[int, int]],
                        h2d: Sequence[tuple[int, int]]) -> None:
        """One step's block moves (``StepPlan.copies``): ``d2h`` (device block, host block)
        pairs, then ``h2d`` (host block, device block) pairs, for every layer's K and V. On
        CUDA they run on a side stream ordered after the queued work; the compute stream waits
        only for what this step reads (see ``engine.kv_cache.host.copier.HostTierCopier``)."""
        self._host_copier.copy(d2h, h2d)

    def _shift_keys(self, shifts: Sequence[KeyShift]) -> None:
        """Streaming eviction's K-shift (``StepPlan.shifts``): re-rotate the K rows of each
        shift's blocks by ``-delta`` in every layer (``engine.kv_format.rope_shift``). Runs
        before the step's copies and forward pass."""
        rot = self.model.rotary
        with torch.inference_mode():
            for sh in shifts:
                idx = torch.tensor(sh.block_ids, dtype=torch.long, device=self.device)
                cos, sin = rot.rows(sh.delta)
                for layer, (k, _) in zip(self.model.layers, self.kv_caches):
                    scale = layer.kv_scales[0] if layer.kv_scales is not None else None
                    shift_block_keys(k, idx, cos, sin, self.kv_format, scale)

    def kv_pool_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self._kv_slots)

    # ---- the step ------------------------------------------------------------------------

    def prepare_for_serving(self) -> None:
        """After the KV pools are allocated: compile every kernel variant a step can launch
        and, on CUDA with the Triton backend, capture the decode graphs (``enforce_eager``
        turns them off). Nothing compiles later, while requests wait."""
        # Not with a hybrid KV cache: the captured graphs hold one group's tables.
        use_graphs = (self.device.type == "cuda" and self.backend.name == "triton"
                      and not self.config.enforce_eager and self.tp is None
                      and not self.kv_layout.is_hybrid)
        if self.device.type != "cuda":
            return
        self._warm_up()
        if not use_graphs:
            return
        sizes = capture_sizes(self.config.max_num_seqs)
        kvh = self.arch.num_kv_heads

        def num_splits(batch: int) -> int:
            from kvserve_kernels.paged_decode import choose_num_splits

            return choose_num_splits(batch, kvh, self.max_model_len, self.device,
                                     head_dim=self.arch.head_dim, dtype=self.dtype)

        # Inside graphs the fused Triton layer ops win (one pass each, launches are free);
        # in eager steps PyTorch's launch faster (docs/performance.md, the H200 figures).
        ops = graph_layer_ops(self.device, self.dtype)

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend, ops)

        self.graphs = DecodeGraphs(forward, self.device, sizes, self.config.block_size,
                                   self.max_model_len, num_splits)
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        self.graphs.capture()
        logger.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s, %.0f MiB, "
                    "layer ops %s", len(sizes), max(sizes), time.perf_counter() - start,
                    max(0, torch.cuda.memory_reserved(self.device) - before) / 2**20,
                    (ops or self.model.ops).name)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata,
                 image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The eager forward pass; ``image_embeds`` (a vision model's step with image
        placeholders): the rows the encoder's embeddings replace."""
        if image_embeds is None:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend,
                          image_embeds=image_embeds)

    def _warm_up(self) -> None:
        """Run steps of the shapes serving will see (a long prefill, short prefills after
        decodes, decodes with one and several splits) so that Triton compiles its variants
        now. Writes only to slots that no request owns yet (the pools are fresh)."""
        bs = self.config.block_size
        n = min(self.config.max_num_batched_tokens, self.max_model_len,
                self.num_blocks * bs)
        # (query lengths, decode splits): a full prefill; prefills after 1-2 decodes (their
        # rows start at odd offsets); decodes in one pass and split.
        shapes = [([n], None), ([1, 1, 3], None), ([1, 6], None), ([1, 20], None),
                  ([1, 17, 40], None)]
        shapes += [([1] * 3, splits) for splits in (1, 2, 4, 8, 16, 32, 64)]  # merge variants
        with torch.inference_mode():
            for q_lens, splits in shapes:
                q_lens = [q for q in q_lens if q <= n] or [1]
                meta = _warmup_metadata(q_lens, bs, self.num_blocks, self.device)
                meta.decode_num_splits = splits
                t = sum(q_lens)
                self._forward(torch.zeros(t, dtype=torch.long, device=self.device),
                              torch.zeros(t, dtype=torch.long, device=self.device), meta)
        torch.cuda.synchronize(self.device)

    @property
    def restricts_logits(self) -> bool:
        """Whether ``execute`` can compute grammar-restricted rows' logits at their allowed
        columns only (engine/runner/logit_columns.py): a packed head on the CPU, unsharded."""
        return self.device.type == "cpu" and self.model.head_columns is not None

    def execute(self, plan: StepPlan, sample_columns: SampleColumns | None = None,
                ) -> StepOutput:
        """One step (``engine.runner.protocol.Runner.execute``): the plan's key shifts and
        block copies, then its chunks packed (``engine.runner.batch``) and run.
        ``sample_columns``: the sampled rows a grammar restricts (``restricts_logits``)."""
        if plan.shifts:  # streaming eviction: before a swap-out copies the blocks
            self._shift_keys(plan.shifts)
        if plan.copies:  # spills, load-backs, swaps: before the model runs
            self._copy_kv_blocks(plan.copies.d2h, plan.copies.h2d)
        if not plan.seqs:
            return StepOutput()
        inp = build_model_input(plan)
        sample_logits, prompt, restricted, pooled = self._run_batch(inp, sample_columns)
        sampled, row = [], 0
        for i, count in zip(inp.sample_seq_indices, inp.sample_counts, strict=True):
            sampled.append((i, range(row, row + count)))
            row += count
        return StepOutput(tuple(sampled), sample_logits,
                          tuple(inp.prompt_rows) if prompt is not None else (), prompt,
                          restricted_rows=tuple(restricted), pooled=pooled)

    @torch.inference_mode()
    def _run_batch(self, inp: ModelInput, sample_columns: SampleColumns | None = None,
                   ) -> tuple[torch.Tensor, PromptLogprobs | None, list[int],
                              tuple[tuple[int, torch.Tensor], ...]]:
        """The forward pass over one packed batch (host data): the sampled rows' logits
        ``[S, V]``, the reduced prompt logprobs (rows as ``inp.prompt_indices``, None when
        none are asked) and the sampled rows computed at their allowed columns only
        (``sample_columns``; engine/runner/logit_columns.py) and the pooling chunks' vectors
        (``_pool``). Pure decode steps replay a CUDA
        graph when one was captured, everything else runs eagerly after one host->device
        copy."""
        if self.lora is not None:
            self.lora.batch = (LoRABatch.build(inp.lora_slots, inp.query_lens, self.device,
                                               row_slots=self.lora.stacked)
                               if inp.lora_slots else None)
        if self.graphs is not None and self.graphs.can_run(inp):
            hidden = self.graphs.run(inp)
            if inp.sample_indices.numel() != hidden.shape[0]:
                hidden = hidden[inp.sample_indices.to(self.device)]
            return self.model.compute_logits(hidden), None, [], ()
        if self._layer_group and not inp.extra_block_tables:
            raise RuntimeError("a hybrid KV cache needs every group's block tables in the plan")
        dev = to_device(inp, self._stager, self._layer_group)
        for meta in dev.group_metas:  # hybrid KV cache: groups 1.. (group 0's is prepared
            self.backend.prepare(meta)  # by the model)
        images = None
        if inp.image_rows:
            if self.vision is None:
                raise RuntimeError("a step computes image placeholders but this runner has "
                                   "no image encoder")
            images = self.vision.rows(inp.image_rows, self.device)
        hidden = self._forward(dev.input_ids, dev.positions, dev.meta, images)
        sample_logits, restricted = restricted_logits(
            self.model, hidden[dev.sample_indices], self.model.arch.vocab_size, sample_columns)
        prompt = None
        if dev.prompt_indices.numel():
            prompt = prompt_logprobs_in_chunks(self.model.compute_logits, hidden,
                                               dev.prompt_indices, dev.prompt_targets,
                                               inp.prompt_top_k, chunk=PROMPT_LOGPROB_CHUNK)
        return sample_logits, prompt, restricted, self._pool(hidden, inp)

    def _pool(self, hidden: torch.Tensor, inp: ModelInput
              ) -> tuple[tuple[int, torch.Tensor], ...]:
        """Per pooling chunk (``SeqChunk.pool``): the float32 sum of its span's final-norm
        hidden states, or the span's last row's logits at its head ids, on the host."""
        out = []
        for i, first, last, head_ids in inp.pool_rows:
            if head_ids:
                ids = torch.tensor(head_ids, dtype=torch.long, device=hidden.device)
                vec = self.model.compute_logits(hidden[last - 1:last])[0].index_select(0, ids)
            else:
                vec = hidden[first:last].float().sum(0)
            out.append((i, vec.cpu()))
        return tuple(out)

    # ---- liveness (nothing outlives a single-device runner) ------------------------------

    def check_health(self) -> None:
        """Nothing can die under a single-device runner: never raises."""

    def idle_work(self) -> bool:
        """A turn of the background probe (``engine.weight_prep.background``; its verdict
        switched in and the decode stack rebuilt once it ends); True while turns remain."""
        if self.background is not None and not self.background.idle_turn(self._restack):
            self.quant_verdict = self.background.verdict or self.quant_verdict
            self.background = None
        return self.background is not None

    def suspend_idle_work(self) -> None:
        if self.background is not None:
            self.background.suspend()

    def _restack(self) -> None:
        if self.model.decode_stack is not None:
            self.model.decode_stack, _ = build_decode_stack(self.model)

    def close(self) -> None:
        """Ends the background probe (the model left as loaded); the pools go with the object."""
        if self.background is not None:
            self.background.close()

    def describe_kernels(self) -> str:
        return (f"attention {self.backend.name} | linears {self.linear_backend} | "
                f"layer ops {self.model.ops.name}")


def _build_on_device(hf_config: Any, max_model_len: int, device: torch.device,
                     dtype: torch.dtype, tp: Any = None):
    """The model with uninitialised weights allocated once, on ``device``, in ``dtype``:
    built on the meta device (no host copy of the weights, no random init), then given
    storage. The RoPE tables, computed at construction, are rebuilt in float32 on the device.
    """
    with torch.device("meta"):
        model = build_model(hf_config, max_positions=max_model_len, tp=tp)
    model = model.to(dtype).to_empty(device=device)
    with torch.device(device):
        model.rotary = RotaryEmbedding(model.arch.rope, model.arch.head_dim, max_model_len)
    return model


def _warmup_metadata(q_lens: list[int], bs: int, num_blocks: int, device: torch.device):
    """Sequences with ``q_lens`` new tokens each and nothing cached, laid out over the pool's
    first blocks (the contents are garbage and are overwritten before any request reads them)."""
    seq_blocks = [-(-q // bs) for q in q_lens]
    width = max(seq_blocks)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    slots = []
    nxt = 0
    for i, (q, nb) in enumerate(zip(q_lens, seq_blocks)):
        ids = [(nxt + j) % num_blocks for j in range(nb)]
        nxt += nb
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // bs] * bs + p % bs for p in range(q)]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(q_lens, dtype=torch.int32,
                                                          device=device),
        block_tables=tables.to(device), block_size=bs, max_query_len=max(q_lens),
        max_seq_len=max(q_lens), num_decodes=nd, num_decode_tokens=nd,
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(q_lens), all_slots_valid=True)
