"""A tensor-parallel rank: load its shard, size its pools with the others, then run rank 0's
orders until told to stop.

:func:`start_rank` is shared by rank 0 (inside ``EngineCore``) and the workers: the same model
construction and the same start-up calls in the same order (``allocate_kv_cache``,
``allocate_host_kv_cache``, ``prepare_for_serving``), so that their collectives pair up. Then a
worker only obeys orders (``engine.distributed.tp_runner`` sends them): ``("step", StepPlan)``
(the same ``Runner.execute`` as rank 0; logits gathered on every rank, only rank 0 samples),
``("ping",)`` (one tiny all-reduce: rank 0's liveness check while idle), ``("kv_...", ...)``
(this rank's share of the disk / remote KV tier's I/O: ``engine.distributed.kv_tiers``),
``("stop",)`` (leave the loop and exit 0).

Any error ends the worker with a non-zero status; rank 0 then sees it dead or its collective
fail, and the server goes down (``/health`` 503, non-zero exit) instead of hanging."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from engine.config.engine import EngineConfig
from engine.models.arch import ModelArch
from engine.models.tp_group import (
    DistributedSetup,
    TPGroup,
    destroy_group,
    init_group,
)
from engine.models.tp_sharding import rank_shard

logger = logging.getLogger("kvserve.distributed")


def pin_to(cores: tuple[int, ...] | None, num_threads: int | None) -> None:
    """Pin this process (its threads to come) to ``cores`` and size torch's thread pool."""
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(num_threads or (len(cores) if cores else torch.get_num_threads()))


def start_rank(config: EngineConfig, setup: DistributedSetup, hf_config: Any, files,
               max_model_len: int):
    """This rank's ``ModelRunner`` over its shard of the weights (the process group must be
    initialised). Logs the rank's shard, load time and resident weight bytes."""
    from engine.distributed.weights import iter_shard_weights
    from engine.runner.device import resolve_device
    from engine.runner.model_runner import ModelRunner

    arch = ModelArch.from_hf_config(hf_config)
    shard = rank_shard(arch, setup.rank, setup.world_size)
    device = resolve_device(config.device)
    if device.type == "cuda":  # one GPU per local rank
        device = torch.device("cuda", setup.local_rank)
        config = config.replace(device=str(device))
    group = TPGroup(setup, shard, device)
    start = time.perf_counter()
    weights = iter_shard_weights(files, shard) if config.load_format != "dummy" else iter(())
    runner = ModelRunner(config, hf_config, weights, max_model_len, files_dir=files.path,
                         tp=group)
    logger.info("rank %d/%d: q heads %s, kv heads %s, mlp %s, vocab %s | loaded in %.2f s, "
                "resident weights %.1f MiB, %d threads, cores %s", setup.rank, setup.world_size,
                shard.q_heads, shard.kv_heads, shard.intermediate, shard.vocab,
                time.perf_counter() - start, runner.weight_bytes / 2**20,
                torch.get_num_threads(),
                sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?")
    return runner


def serve_orders(runner, files=None, hf_config=None) -> None:
    """The worker's side of the start-up, then its order loop (returns on ``stop``).
    ``files``, ``hf_config``: the model's, for the stored KV tier's fingerprint."""
    config = runner.config
    runner.allocate_kv_cache()
    if runner.allocate_host_kv_cache() == 0 and config.stored_kv_tier:
        # the stored tier's staging area: the same call as EngineCore's on rank 0
        from engine.kv_cache.disk.build import staging_blocks

        runner.allocate_host_kv_cache(staging_blocks(runner, config, runner.max_model_len))
    runner.prepare_for_serving()
    logger.info("rank %d: KV pool %d blocks (%.2f GiB); serving", runner.tp.rank,
                runner.num_blocks, runner.kv_pool_bytes() / 2**30)
    tiers = None
    if config.stored_kv_tier:  # this rank's share of the disk / remote KV tier
        from engine.distributed.kv_tiers import RankStores

        tiers = RankStores(config, runner, files.path, hf_config)
    group: TPGroup = runner.tp
    try:
        while True:
            order = group.recv_order()
            kind = order[0]
            if kind == "step":
                runner.execute(order[1])
            elif kind == "ping":
                group.ping()
            elif kind == "stop":
                return
            elif kind.startswith("kv_") and tiers is not None:
                tiers.handle(order)
            else:
                raise RuntimeError(f"unknown order {kind!r} from rank 0")
    finally:
        if tiers is not None:
            tiers.close()


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker must not outlive the server that spawned it."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


def worker_main(config: EngineConfig, setup: DistributedSetup, cores: tuple[int, ...] | None,
                log_level: int, parent_pid: int | None) -> None:
    """Entry point of a worker process (or of a torchrun rank > 0)."""
    from engine.loading.loader import load_config, resolve_model

    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [rank {setup.rank}] %(name)s: "
                               f"%(message)s")
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    status = 0
    try:
        pin_to(cores, config.num_threads)
        init_group(setup)
        files = resolve_model(config.model, progress=False)
        hf_config = load_config(files)
        runner = start_rank(config, setup, hf_config, files, config.resolve_max_model_len(hf_config))
        with torch.inference_mode():
            serve_orders(runner, files, hf_config)
    except BaseException as exc:  # noqa: BLE001 - report, then a non-zero exit
        logger.error("rank %d failed: %s: %s", setup.rank, type(exc).__name__, exc,
                     exc_info=not isinstance(exc, KeyboardInterrupt))
        status = 1
    finally:
        if status == 0:
            destroy_group()
    sys.exit(status)
