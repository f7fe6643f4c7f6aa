"""Where the ranks of a tensor-parallel group run and how they meet.

One host (``nnodes == 1``): this process is rank 0 (server, scheduler, KV bookkeeping and one
model shard) and spawns ranks 1..N-1 itself (``torch.multiprocessing``, spawn start method),
meeting on a free loopback port. Several hosts: each runs ``kvserve serve`` with the same
``--tensor-parallel-size``, ``--nnodes`` and ``--distributed-init-method tcp://HOST0:PORT`` and
its own ``--node-rank``; node 0 holds ranks 0..N/nnodes-1 and serves HTTP, the others spawn
their ranks and wait. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the
environment) every process is one rank and nothing is spawned.

On the CPU each local rank is pinned to its own cores (``os.sched_setaffinity``) when there are
at least as many cores as local ranks, and runs that many torch threads.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

import torch

from engine import envs
from engine.config.engine import EngineConfig
from engine.models.tp_group import DistributedSetup

logger = logging.getLogger("kvserve.distributed")


@dataclass(frozen=True)
class LaunchPlan:
    """This host's share of the group: ``local_ranks`` (``spawn``: those this process starts;
    the first local rank of node 0 is this process itself), the rendezvous and the cores."""

    world_size: int
    local_ranks: tuple[int, ...]
    init_method: str
    spawn: tuple[int, ...]
    cores: dict[int, tuple[int, ...]] = field(default_factory=dict)
    backend: str = "gloo"

    local_rank_base: int | None = None  # torchrun's LOCAL_RANK for its one rank

    def setup(self, rank: int, timeout_s: float) -> DistributedSetup:
        local = (self.local_rank_base if self.local_rank_base is not None
                 else self.local_ranks.index(rank))
        return DistributedSetup(self.init_method, rank, self.world_size, self.backend, timeout_s,
                                local)


def split_cores(cores: list[int], n: int) -> list[tuple[int, ...]] | None:
    """``cores`` in ``n`` contiguous, disjoint, near-even groups; None when fewer than ``n``."""
    if len(cores) < n:
        return None
    return [tuple(cores[len(cores) * i // n:len(cores) * (i + 1) // n]) for i in range(n)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_plan(config: EngineConfig, env: dict[str, str] | None = None,
                device_type: str = "cpu") -> LaunchPlan:
    """Read the rendezvous from ``config`` and the environment (torchrun's variables win)."""
    env = dict(envs.torchrun_env() if env is None else env)
    world = config.tensor_parallel_size
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun: one process per rank
        if int(env["WORLD_SIZE"]) != world:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} in the environment but "
                             f"tensor_parallel_size={world}")
        rank = int(env["RANK"])
        init = config.distributed_init_method or "env://"
        return LaunchPlan(world, (rank,), init, (), {}, backend,
                          int(env.get("LOCAL_RANK", 0)))
    per_node = world // config.nnodes
    first = config.node_rank * per_node
    local = tuple(range(first, first + per_node))
    init = config.distributed_init_method
    if init is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        init = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if init is None:
        if config.nnodes > 1:
            raise ValueError("tensor parallelism across hosts needs a meeting point: "
                             "--distributed-init-method tcp://NODE0_HOST:PORT (the same on "
                             "every host) or MASTER_ADDR and MASTER_PORT")
        init = f"tcp://127.0.0.1:{free_port()}"
    spawn = local[1:] if config.node_rank == 0 else local
    cores: dict[int, tuple[int, ...]] = {}
    if device_type == "cpu" and hasattr(os, "sched_getaffinity"):
        groups = split_cores(sorted(os.sched_getaffinity(0)), len(local))
        if groups is not None:
            cores = dict(zip(local, groups))
        else:
            logger.warning("%d local ranks on %d cores: ranks are not pinned", len(local),
                           len(os.sched_getaffinity(0)))
    return LaunchPlan(world, local, init, spawn, cores, backend)


class LocalWorkers:
    """The worker processes this process spawned; watched for liveness."""

    def __init__(self, config: EngineConfig, plan: LaunchPlan, log_level: int) -> None:
        from engine.distributed.worker import worker_main

        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = {}
        for rank in plan.spawn:
            proc = ctx.Process(target=worker_main, name=f"kvserve-tp-rank{rank}", daemon=False,
                               args=(config, plan.setup(rank, config.distributed_timeout),
                                     plan.cores.get(rank), log_level, os.getpid()))
            proc.start()
            self.procs[rank] = proc
        logger.info("tensor parallel: spawned ranks %s (pids %s)", list(self.procs),
                    [p.pid for p in self.procs.values()])

    def dead(self) -> str | None:
        """Which worker has exited (and how), or None while all run."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {proc.exitcode}"
        return None

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all, then kill what is left."""
        import time

        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def wait(self) -> int:
        """Block until every worker exits; 0 if all exited cleanly, else 1."""
        from multiprocessing.connection import wait

        pending = dict(self.procs)
        status = 0
        while pending:
            for sentinel in wait([p.sentinel for p in pending.values()]):
                rank = next(r for r, p in pending.items() if p.sentinel == sentinel)
                proc = pending.pop(rank)
                proc.join()
                if proc.exitcode != 0:
                    logger.error("tensor-parallel rank %d exited with %s", rank, proc.exitcode)
                    status = 1
        return status


def run_worker_node(config: EngineConfig) -> int:
    """A host without the server (``node_rank > 0``, or a torchrun rank > 0): run its ranks
    until rank 0 stops them; the exit status is non-zero if any rank failed."""
    level = logging.getLogger("kvserve").getEffectiveLevel()
    plan = launch_plan(config)
    if not plan.spawn:  # torchrun: this process is the rank
        from engine.distributed.worker import worker_main

        rank = plan.local_ranks[0]
        try:
            worker_main(config, plan.setup(rank, config.distributed_timeout), None, level, None)
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0
    return LocalWorkers(config, plan, level).wait()
