"""Rank 0's model runner under tensor parallelism (``engine.distributed.runner_factory`` builds it).

:class:`TensorParallelRunner` implements the runner seam (``engine.runner.protocol.Runner``)
over rank 0's own ``ModelRunner``: its start-up and geometry members are rank 0's (whose sizing
methods already agree with the other ranks), and before rank 0 runs a step on its shard, every
worker is sent the same plain data (the ``StepPlan``: its block copies, then its forward pass).
Workers answer nothing; the logits are gathered inside the forward pass, and rank 0 alone
samples.

Liveness: a spawned worker that has exited is noticed before each step and by
:meth:`check_health` (the engine loop calls it while idle, which also pings every rank, remote
ones included); a collective that fails or passes ``distributed_timeout`` raises. Either way the
exception reaches ``AsyncEngine``, which marks the engine dead: ``/health`` answers 503 and the
server exits non-zero.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from engine.config.engine import EngineConfig
from engine.distributed.launcher import LocalWorkers, launch_plan
from engine.distributed.worker import pin_to, start_rank
from engine.models.tp_group import destroy_group, init_group
from engine.step.output import StepOutput
from engine.step.plan import StepPlan

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

logger = logging.getLogger("kvserve.distributed")

HEALTH_CHECK_INTERVAL_S = 1.0
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot run another step."""


def _rank0(name: str, doc: str) -> property:
    """A read-only member that is rank 0's runner's own (the same on every rank)."""
    return property(lambda self: getattr(self._runner, name), doc=doc)


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group, as one ``Runner``."""

    health_check_interval = HEALTH_CHECK_INTERVAL_S

    device = _rank0("device", "Rank 0's device.")
    dtype = _rank0("dtype", "The activations' dtype (every rank's).")
    arch = _rank0("arch", "The whole model's architecture.")
    quant_verdict = _rank0("quant_verdict", "Rank 0's quantisation verdict.")
    quantized = _rank0("quantized", "Whether rank 0 runs packed quantised weights.")
    linear_backend = _rank0("linear_backend", "How rank 0's float linears multiply.")
    kv_cache_dtype = _rank0("kv_cache_dtype", "The pools' resolved kv_cache_dtype.")
    kv_format = _rank0("kv_format", "How one K or V row is stored.")
    kv_layout = _rank0("kv_layout", "The KV groups.")
    kv_bytes_per_token = _rank0("kv_bytes_per_token", "One token's K and V on one rank.")
    kv_page_bytes_per_token = _rank0("kv_page_bytes_per_token",
                                     "One token of one pool block on one rank.")
    num_blocks = _rank0("num_blocks", "Blocks in each rank's pool.")
    kv_caches = _rank0("kv_caches", "Rank 0's device pools.")
    host_kv_caches = _rank0("host_kv_caches", "Rank 0's host pools.")

    def __init__(self, runner: ModelRunner, workers: LocalWorkers | None,
                 old_affinity: set[int] | None) -> None:
        self._runner = runner
        self.tp = runner.tp
        self._workers = workers
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, runner.tp, workers, old_affinity,
                                           [False])

    @classmethod
    def launch(cls, config: EngineConfig, hf_config: Any, files,
               max_model_len: int) -> TensorParallelRunner:
        from engine.runner.device import resolve_device

        device = resolve_device(config.device)
        plan = launch_plan(config, device_type=device.type)
        if config.node_rank != 0 or plan.local_ranks[0] != 0:
            raise ValueError("this process is not rank 0: run it as a worker node "
                             "(kvserve serve with --node-rank > 0 runs no server)")
        old = set(os.sched_getaffinity(0)) if plan.cores.get(0) else None
        workers = LocalWorkers(config, plan, logging.getLogger("kvserve").getEffectiveLevel())
        try:
            pin_to(plan.cores.get(0), config.num_threads)
            init_group(plan.setup(0, config.distributed_timeout))
            runner = start_rank(config, plan.setup(0, config.distributed_timeout), hf_config,
                                files, max_model_len)
        except BaseException:
            _shutdown(None, workers, old, [False])
            raise
        return cls(runner, workers, old)

    # ---- start-up: every call pairs with the workers' own (engine.distributed.worker) ----

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        return self._runner.allocate_kv_cache(num_blocks)

    def calibrate_kv_scales(self, token_ids):
        return self._runner.calibrate_kv_scales(token_ids)

    def allocate_host_kv_cache(self, num_blocks: int | None = None) -> int:
        return self._runner.allocate_host_kv_cache(num_blocks)

    def prepare_for_serving(self) -> None:
        self._runner.prepare_for_serving()

    def wait_host_copies(self) -> None:
        self._runner.wait_host_copies()

    def kv_pool_bytes(self) -> int:
        return self._runner.kv_pool_bytes()

    def describe_kernels(self) -> str:
        return self._runner.describe_kernels()

    # ---- orders ------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """Send ``plan`` to every worker, then run it on rank 0's shard (block moves and
        forward pass on each rank; the collectives inside pair up)."""
        with self._collectives("a step" if plan.seqs else "a block copy"):
            self.tp.send_order(("step", plan))
            return self._runner.execute(plan)

    def stored_tier_shards(self):
        """The other ranks' shares of the disk / remote KV tier, driven by rank 0's
        ``DiskTier`` (``engine.distributed.kv_tiers``)."""
        from engine.distributed.kv_tiers import StoredTierShards

        return StoredTierShards(self)

    def tier_order(self, order: tuple, counts: list[int] | None = None,
                   barrier: bool = False) -> list[int] | None:
        """Send a stored-tier order to every worker (``engine.distributed.kv_tiers``); with
        ``counts``, return their minimum over ranks, element by element; with ``barrier``,
        return once every worker has carried it out."""
        with self._collectives("a KV tier order"):
            self.tp.send_order(order)
            if counts is not None:
                return self.tp.min_ints(counts)
            if barrier:
                self.tp.ping()
        return None

    def idle_work(self) -> bool:
        return False  # no probe under tensor parallelism: ranks must agree without talking

    def suspend_idle_work(self) -> None:
        """Nothing put aside."""

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` when a rank is gone or does not answer in time."""
        with self._collectives("a liveness ping"):
            self.tp.send_order(("ping",))
            self.tp.ping()

    @contextmanager
    def _collectives(self, what: str) -> Iterator[None]:
        """Check the spawned workers first; turn a failed or timed-out collective into
        ``WorkerDiedError`` naming the cause (a dead worker, else the timeout)."""
        self._check_workers()
        try:
            yield
        except _OUT_OF_MEMORY:
            raise
        except RuntimeError as exc:  # torch.distributed's errors (DistError) included
            if isinstance(exc, WorkerDiedError):
                raise
            why = (self._workers.dead() if self._workers is not None else None) or (
                f"a rank did not answer within distributed_timeout={self.tp.timeout_s:g} s "
                f"or its connection broke")
            raise WorkerDiedError(f"tensor parallelism: {what} failed: {why} "
                                  f"({type(exc).__name__}: {exc})") from exc

    def _check_workers(self) -> None:
        if self._closed:
            raise WorkerDiedError("the tensor-parallel group was shut down")
        why = self._workers.dead() if self._workers is not None else None
        if why is not None:
            raise WorkerDiedError(why)

    def close(self) -> None:
        """Stop the workers (an order, then a bounded wait, then kill) and leave the group."""
        self._closed = True
        self._finalizer()


def _shutdown(group, workers: LocalWorkers | None, old_affinity: set[int] | None,
              done: list[bool]) -> None:
    if done[0]:
        return
    done[0] = True
    if group is not None and workers is not None and workers.dead() is None:
        try:
            group.send_order(("stop",))
        except Exception:  # noqa: BLE001 - a dead peer: kill below
            logger.debug("stop order failed", exc_info=True)
    if workers is not None:
        workers.join(timeout=5.0)
    destroy_group()
    if old_affinity:
        os.sched_setaffinity(0, old_affinity)
