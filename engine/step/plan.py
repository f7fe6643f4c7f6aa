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

from engine.params.prompt_image import PromptImage


@dataclass(frozen=True, slots=True)
class PromptLogitSpan:
    """Positions ``[first, last)`` of one scheduled chunk whose prompt logprobs are recorded:
    position ``p`` predicts prompt token ``p + 1`` (``targets[p - first]``)."""

    # First position of the span (absolute, in the sequence's tokens).
    first: int
    # One past the last position of the span.
    last: int
    # The prompt token each position predicts; len == last - first.
    targets: tuple[int, ...]
    # How many alternatives per position the request asked for.
    top_k: int


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """Positions ``[first, last)`` of one scheduled chunk whose final-norm hidden states are
    summed for a pooling request (``engine.pooling``)."""

    # First position of the span.
    first: int
    # One past the last position of the span.
    last: int
    # Non-empty: one row (the prompt's last), and the logits at these ids replace the sum.
    head_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SeqChunk:
    """One scheduled sequence's share of the step. Read-only by contract (its lists are the
    plan's own copies); not frozen because one is built per sequence per step and a frozen
    dataclass costs more to construct (docs/decisions.md#small-cpu-costs)."""

    # Tokens computed this step, at positions start .. start + len(token_ids) - 1.
    token_ids: list[int]
    # First position computed; the keys of positions 0 .. start - 1 are already in the pool.
    start: int
    # The sequence's blocks in token order, covering start + len(token_ids) tokens: token p
    # lives in slot block_table[p // block_size] * block_size + p % block_size (group 0's).
    block_table: list[int]
    # The chunk reaches the last known token and its last row's logits are sampled.
    sample: bool
    # Prompt positions whose logprobs are recorded (None: none).
    prompt_logits: PromptLogitSpan | None = None
    # Speculative decoding: the last num_draft token ids are drafted guesses after the last
    # known token; the last num_draft + 1 rows are all sampled (row j verifies draft token j,
    # the last row gives the token after the whole draft).
    num_draft: int = 0
    # Hybrid KV cache only: the block tables of KV groups 1.., laid out like block_table; a
    # window group's leading entries may be -1 (released).
    extra_tables: tuple[list[int], ...] = ()
    # The rows a pooling request sums (engine.pooling); such a chunk never samples.
    pool: PoolSpan | None = None
    # The LoRA slot the chunk runs under (engine.lora; -1: the base model).
    lora_slot: int = -1
    # The prompt's images whose placeholders this chunk computes (some or all of them): their
    # rows take the encoder's embeddings, their spans attend both ways. The scheduler never
    # ends a chunk inside an image's span.
    images: tuple[PromptImage, ...] = ()

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
    ``d2h`` first. Destinations are distinct within each list. There are no device->device
    (copy-on-write) orders: only full blocks are ever shared, and a full block is never written
    again."""

    # (device block, host block): spills of evicted cached blocks, swap-outs of preempted
    # sequences.
    d2h: tuple[tuple[int, int], ...] = ()
    # (host block, device block): load-backs of host prefix hits, swap-ins.
    h2d: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.d2h or self.h2d)


@dataclass(frozen=True, slots=True)
class KeyShift:
    """Re-rotate the K rows of ``block_ids`` (whole blocks, every layer) from position ``p``
    to ``p - delta`` (streaming eviction moved them ``delta`` cache positions down)."""

    # Cache positions the keys moved down by.
    delta: int
    # The blocks whose K rows are re-rotated, every layer.
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: the key shifts, then the copies, then the forward pass over ``seqs``."""

    # The scheduled chunks in row order: decodes (one new token) first, then speculating
    # decodes. May be empty while copies is not (every candidate was preempted and swapped out).
    seqs: tuple[SeqChunk, ...]
    # Tokens per KV block of the pool.
    block_size: int
    # Block moves to run before the forward pass (after the shifts).
    copies: BlockCopyOrders = field(default_factory=BlockCopyOrders)
    # Streaming eviction (engine.kv_cache.streaming): key re-rotations to run before the
    # copies, moving kept keys to their new cache positions.
    shifts: tuple[KeyShift, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
