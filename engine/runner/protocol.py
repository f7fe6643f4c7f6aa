"""The runner seam: what ``EngineCore`` (and a draft-model proposer) may ask of a model runner.

One call a step, as in vLLM and nano-vllm: :meth:`Runner.execute` takes the scheduler's plain
``StepPlan`` and returns a ``StepOutput`` indexed by the plan's chunks. Everything between
(streaming eviction's key shifts, the host tier's block copies, packing the chunks into one
flat batch, the forward pass, prompt logprobs) happens behind it; the core never sees the
packed layout. The other members are the start-up sequence (pools, kernels), the KV geometry
the core sizes its bookkeeping with, and liveness.

Implementations: ``engine.runner.model_runner.ModelRunner`` (one device, also a speculative
draft model's runner) and ``engine.distributed.tp_runner.TensorParallelRunner`` (rank 0 of a
tensor-parallel group: it forwards every plan to the workers, then runs rank 0's shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.kv_cache.groups import KVGroupLayout
    from engine.kv_format.formats import KVFormat
    from engine.models.arch import ModelArch
    from engine.quantization.probe import Verdict
    from engine.step.output import StepOutput
    from engine.step.plan import StepPlan


class Runner(Protocol):
    """A model runner. Calls come from one thread (the engine's), in this order at start-up:
    ``allocate_kv_cache``, optionally ``calibrate_kv_scales``, ``allocate_host_kv_cache``
    (zero, one or two calls), ``prepare_for_serving``; then ``execute`` once per step, with
    ``check_health`` between steps; ``close`` last."""

    # ---- what was loaded -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device the weights and KV pools live on (rank 0's under tensor parallelism)."""

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and float weights') dtype."""

    @property
    def arch(self) -> ModelArch:
        """The model's architecture: layers, heads, vocabulary, sliding windows."""

    @property
    def quant_verdict(self) -> Verdict | None:
        """Which batch sizes run on packed quantised weights (None: no quantised module)."""

    @property
    def quantized(self) -> bool:
        """Whether any batch size runs on packed quantised weights."""

    @property
    def linear_backend(self) -> str:
        """How the float linears multiply (``"torch"``: plain ``nn.Linear``)."""

    def describe_kernels(self) -> str:
        """One log fragment naming the attention backend, linears and layer ops in use."""

    # ---- KV geometry and pools -------------------------------------------------------------

    @property
    def kv_cache_dtype(self) -> str:
        """The pools' ``kv_cache_dtype``, ``"auto"`` already resolved."""

    @property
    def kv_format(self) -> KVFormat:
        """How one K or V row is stored (row bytes, scales)."""

    @property
    def kv_layout(self) -> KVGroupLayout:
        """The KV groups: one, or a hybrid model's groups sharing the pool's pages."""

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's K and V take in the pools, every layer, on this rank."""

    @property
    def kv_page_bytes_per_token(self) -> int:
        """What one token of one pool block takes (one KV group's layers)."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool (0 before ``allocate_kv_cache``)."""

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(K, V)`` pool on this device (rank 0's shard under tensor
        parallelism); for the disk tier's and tests' reads, between steps only."""

    @property
    def host_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The host tier's pools, one per pool tensor (empty without a host tier)."""

    def kv_pool_bytes(self) -> int:
        """Bytes of the device pools on this device."""

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Size (from the memory budget, or ``num_blocks``) and allocate the device pools once;
        returns the number of blocks, the same on every rank. ValueError when not one block
        fits."""

    def calibrate_kv_scales(self, token_ids: Sequence[int]
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """fp8 pools only, before serving: set each layer's per-head K/V scales from one
        prefill of ``token_ids``; returns them."""

    def allocate_host_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the host tier's pools (sized by ``swap_space``, or ``num_blocks``); returns
        the number of host blocks, 0 when the tier is off."""

    def wait_host_copies(self) -> None:
        """Block until the host pools hold every block written back so far."""

    def prepare_for_serving(self) -> None:
        """After the pools: compile every kernel variant a step launches, capture CUDA graphs
        where they serve. Nothing compiles later."""

    # ---- the step --------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step: ``plan.shifts``, then ``plan.copies`` (device->host first), then the
        forward pass over ``plan.seqs`` (none: moves only, the empty output). Returns the
        sampled rows' logits and the asked prompt logprobs, indexed by chunk. Device
        out-of-memory propagates as ``torch.OutOfMemoryError``; any other exception means the
        runner's state can no longer be trusted."""

    # ---- liveness --------------------------------------------------------------------------

    @property
    def health_check_interval(self) -> float | None:
        """Seconds between ``check_health`` calls while idle (None: nothing to check)."""

    def idle_work(self) -> bool:
        """While no request is unfinished: one bounded turn of work that only makes later
        steps faster (a probe measured after start-up); True while some remains."""

    def suspend_idle_work(self) -> None:
        """Before any step or task: the model as it serves (idle work's changes put aside)."""

    def check_health(self) -> None:
        """Raise when the runner can no longer run a step (a tensor-parallel worker died)."""

    def close(self) -> None:
        """Release what outlives the object (tensor-parallel workers). Idempotent."""
