"""The step plan: what the scheduler hands the model side for one engine step, as plain data.

A :class:`StepPlan` names no ``Sequence``, no scheduler and no KV manager: token ids,
positions, block tables, which rows sample, which prompt positions need logits, and the block
copies to run before the forward pass. It is what the model runner's one call takes
(``engine.runner.protocol.Runner.execute``), and what a remote tensor-parallel worker
receives.

Contract: a plan is a snapshot taken at the end of ``Scheduler.schedule``. Its block tables
already cover every token it computes (the scheduler allocated them), its copies must run
before its forward pass (device->host first, then host->device), and nothing in it changes
when the scheduler's state moves on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PromptLogitSpan:
    """Positions ``[first, last)`` of one scheduled chunk whose prompt logprobs are recorded:
    position ``p`` predicts prompt token ``p + 1`` (``targets[p - first]``), with the ``top_k``
    alternatives the request asked for."""

    first: int
    last: int
    targets: tuple[int, ...]  # len == last - first
    top_k: int


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """Positions ``[first, last)`` of one scheduled chunk whose final-norm hidden states are
    summed for a pooling request (``engine.pooling``); with ``head_token_ids`` (one row, the
    prompt's last) the logits at those ids instead."""

    first: int
    last: int
    head_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SeqChunk:
    """One scheduled sequence's share of the step. Read-only by contract (its lists are the
    plan's own copies); not frozen because one is built per sequence per step and a frozen
    dataclass costs more to construct (docs/performance.md#small-cpu-costs).

    It computes ``token_ids`` at positions ``start .. start + len(token_ids) - 1``; the keys
    of positions ``0 .. start - 1`` are already in the pool. ``block_table`` lists the
    sequence's blocks in token order and covers ``start + len(token_ids)`` tokens, so token
    ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
    ``extra_tables`` (hybrid KV cache only): the block tables of KV groups ``1..``, laid out
    like ``block_table`` (group 0's); a window group's leading entries may be -1 (released).
    ``sample``: the chunk reaches the last known token and its last row's logits are sampled.
    ``num_draft`` (speculative decoding): the last ``num_draft`` token ids are drafted guesses
    that follow the last known token; then the last ``num_draft + 1`` rows are all sampled
    (row j verifies draft token j, the last row gives the token after the whole draft).
    ``pool``: the rows a pooling request sums (``engine.pooling``); such a chunk never samples.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    prompt_logits: PromptLogitSpan | None = None
    num_draft: int = 0
    extra_tables: tuple[list[int], ...] = ()
    pool: PoolSpan | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Keys attended by the chunk's last token (cached + new)."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BlockCopyOrders:
    """Block moves between the device pool and the host tier, to run before the forward pass,
    ``d2h`` first. ``d2h`` pairs are (device block, host block): spills of evicted cached blocks
    and swap-outs of preempted sequences. ``h2d`` pairs are (host block, device block):
    load-backs of host prefix hits and swap-ins. Destinations are distinct within each list.
    There are no device->device (copy-on-write) orders: only full blocks are ever shared, and a
    full block is never written again."""

    d2h: tuple[tuple[int, int], ...] = ()
    h2d: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.d2h or self.h2d)


@dataclass(frozen=True, slots=True)
class KeyShift:
    """Re-rotate the K rows of ``block_ids`` (whole blocks, every layer) from position ``p``
    to ``p - delta`` (streaming eviction moved them ``delta`` cache positions down)."""

    delta: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: ``seqs`` in row order (decodes — one new token — first, then speculating
    decodes), the pool's
    ``block_size``, the key shifts and then the copies to run first. ``seqs`` may be empty
    while ``copies`` is not
    (every candidate was preempted and swapped out)."""

    seqs: tuple[SeqChunk, ...]
    block_size: int
    copies: BlockCopyOrders = field(default_factory=BlockCopyOrders)
    # Streaming eviction (``engine.kv_cache.streaming``): key re-rotations to run before the
    # copies, moving kept keys to their new cache positions.
    shifts: tuple[KeyShift, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
