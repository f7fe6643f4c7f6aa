"""One tensor-parallel group: this process's rank, the process groups, and the collectives the
model and the runner use. Passed explicitly (no module-level "current group").

Two gloo/NCCL groups over the same ranks:

- ``compute``: the model's all-reduces and gathers and the runner's start-up agreements, under
  ``distributed_timeout`` seconds: a worker that died or hangs turns a step into an error on
  rank 0 within that time, never a hang.
- ``control``: rank 0's orders to the workers (a step plan, block copies, a ping, stop, the
  stored KV tier's reads and writes), on the CPU (gloo) always. A worker waits there for as
  long as the engine is idle, so its timeout is long; a rank 0 that exits closes its sockets
  and the worker's wait ends at once.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.models.tp_sharding import RankShard

logger = logging.getLogger("kvserve.distributed")

CONTROL_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class DistributedSetup:
    """How this process joins the group: ``init_method`` (``tcp://host:port`` or ``env://``),
    its global ``rank`` and the ``world_size``; ``backend`` gloo (CPU) or nccl (CUDA);
    ``local_rank``: its index among this host's ranks (its GPU, ``cuda:<local_rank>``)."""

    init_method: str
    rank: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    local_rank: int = 0


class TPGroup:
    """This rank's view of the tensor-parallel group (``shard``: what it holds)."""

    def __init__(self, setup: DistributedSetup, shard: RankShard,
                 device: torch.device) -> None:
        self.rank, self.world = setup.rank, setup.world_size
        self.shard = shard
        self.device = device
        self.timeout_s = setup.timeout_s
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self._vocab_sizes = shard.vocab_sizes
        self._vocab_pad = max(self._vocab_sizes)

    # ---- model collectives (every rank, same order) ----------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place (row-parallel O / down, the vocab-parallel lookup)."""
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """``[S, vocab_r]`` logits of each rank's token range -> ``[S, vocab]`` on every rank
        (all ranks reduce prompt logprobs the same way, so every rank needs the whole row)."""
        s = local.shape[0]
        if local.shape[1] < self._vocab_pad:  # all_gather wants equal shapes
            local = torch.nn.functional.pad(local, (0, self._vocab_pad - local.shape[1]))
        parts = [torch.empty(s, self._vocab_pad, dtype=local.dtype, device=local.device)
                 for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.compute)
        return torch.cat([p[:, :n] for p, n in zip(parts, self._vocab_sizes)], dim=1)

    def min_int(self, value: int) -> int:
        """The minimum of ``value`` over ranks (the KV pool sizes)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._reduce_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.compute)
        return int(t.item())

    def min_ints(self, values: list[int]) -> list[int]:
        """The minimum over ranks of each of ``values`` (every rank passes as many)."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64,
                         device=self._reduce_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.compute)
        return [int(v) for v in t.tolist()]

    def ping(self) -> None:
        """A tiny all-reduce: fails (or times out) when a rank died or hangs."""
        t = torch.zeros(1, device=self._reduce_device)
        dist.all_reduce(t, group=self.compute)

    @property
    def _reduce_device(self) -> torch.device:
        return self.device if dist.get_backend(self.compute) == "nccl" else torch.device("cpu")

    # ---- rank 0's orders ---------------------------------------------------------------------

    def send_order(self, order: Any) -> None:
        """Rank 0: broadcast ``order`` (plain data) to every worker: one pickled byte tensor,
        its length first. Waits at most ``timeout_s`` for the workers to take it (gloo sends
        only to a posted receive: a hung worker would block the control group's long wait)."""
        data = torch.frombuffer(bytearray(pickle.dumps(order, protocol=5)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for t in (size, data):
            dist.broadcast(t, src=0, group=self.control, async_op=True).wait(timeout=timeout)

    def recv_order(self) -> Any:
        """A worker: wait for rank 0's next order."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return pickle.loads(data.numpy().tobytes())


def init_group(setup: DistributedSetup) -> None:
    """Join the default process group (``compute``) with ``setup.timeout_s`` on collectives."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one "
                           "tensor-parallel engine per process")
    dist.init_process_group(backend=setup.backend, init_method=setup.init_method,
                            rank=setup.rank, world_size=setup.world_size,
                            timeout=datetime.timedelta(seconds=setup.timeout_s))


def destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a dead peer must not stop the shutdown
            logger.debug("destroy_process_group failed", exc_info=True)
