"""Draft-model proposer: a small model of the same vocabulary proposes its greedy continuation.

It runs its own runner (a ``ModelRunner`` with weights and a paged KV pool of as many blocks as
the target's) and its own ``KVCacheManager`` (no prefix caching; a ``HybridKVCacheManager`` for a
draft mixing sliding-window and full attention), on the engine thread, inside the scheduler's
``propose`` call; per sequence it remembers the tokens whose K/V its pool holds (``_fed``). One
``propose`` call, batched over the sequences asking for drafts: (1) sync: the draft's K/V past
the first position where what it fed differs from the context is rolled back
(``KVCacheManager.truncate``); (2) catch-up: one step computes each sequence's missing tokens,
draft token 0 the argmax at the last (at most ``max_step_tokens`` per call: a sequence whose
catch-up does not fit gets a chunk and no draft this step); (3) k - 1 one-row steps.

Greedy drafts are deterministic functions of the context, so the verifier's point-mass rule
keeps the output exactly the target's, sampling included. A sequence whose draft blocks cannot
be allocated gets no draft this step. ``release`` frees a finished sequence's draft state."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.kv_cache.manager import KVCacheManager
from engine.runner.protocol import Runner
from engine.sampling.argmax import first_argmax
from engine.spec_decode.proposer import DraftRequest
from engine.step.plan import SeqChunk, StepPlan


class DraftModelProposer:
    """``Proposer`` over a draft ``runner`` whose KV pool is allocated (``num_blocks``)."""

    def __init__(self, runner: Runner, num_blocks: int, block_size: int,
                 num_speculative_tokens: int, max_step_tokens: int = 2048) -> None:
        self.runner = runner
        self.max_step_tokens = max_step_tokens
        self.block_size = block_size
        self.k = num_speculative_tokens
        layout = runner.kv_layout
        self.kv = (HybridKVCacheManager(num_blocks, block_size, layout,
                                        enable_prefix_caching=False) if layout.is_hybrid
                   else KVCacheManager(num_blocks, block_size, enable_prefix_caching=False))
        self._hybrid = layout.is_hybrid
        self._fed: dict[str, list[int]] = {}  # tokens whose K/V the draft pool holds
        self._checked: dict[str, int] = {}  # a prefix of _fed known to equal the context

    def release(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self._fed.pop(seq_id, None)
        self._checked.pop(seq_id, None)

    def _chunk(self, seq_id: str, token_ids: list[int], start: int, sample: bool) -> SeqChunk:
        """A step's share for ``seq_id``: its tables (every KV group's, for a hybrid draft)."""
        if not self._hybrid:
            return SeqChunk(token_ids, start, self.kv.block_table(seq_id), sample)
        tables = self.kv.group_tables(seq_id)
        return SeqChunk(token_ids, start, tables[0], sample, extra_tables=tables[1:])

    def propose(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in batch]
        live: list[int] = []  # indices into batch that draft this step
        chunks: list[tuple[SeqChunk, int | None]] = []  # (catch-up chunk, batch index)
        budget = self.max_step_tokens
        for i, r in enumerate(batch):
            ctx = r.token_ids
            n = self._sync(r.seq_id, ctx)
            if self._hybrid:  # no later rollback goes below n: what its window left is free
                self.kv.release_outside_window(r.seq_id, n)
            end = min(len(ctx), n + budget)
            if end == n or self.kv.allocate(r.seq_id, len(ctx) + r.max_tokens - 1) is None:
                continue
            whole = end == len(ctx)
            chunks.append((self._chunk(r.seq_id, list(ctx[n:end]), n, whole),
                           i if whole else None))
            budget -= end - n
            self._fed[r.seq_id] = list(ctx[:end])
            self._checked[r.seq_id] = end
            if whole:
                live.append(i)
        if not chunks:
            return drafts
        chunks.sort(key=lambda c: len(c[0].token_ids) != 1)
        tokens = self._step([c for c, _ in chunks])
        for i, tok in zip([i for _, i in chunks if i is not None], tokens, strict=True):
            drafts[i].append(tok)
        for _ in range(1, self.k):
            want = [i for i in live if len(drafts[i]) < batch[i].max_tokens]
            if not want:
                break
            step_chunks = []
            for i in want:
                seq_id, tok = batch[i].seq_id, drafts[i][-1]
                fed = self._fed[seq_id]
                step_chunks.append(self._chunk(seq_id, [tok], len(fed), True))
                fed.append(tok)
            for i, tok in zip(want, self._step(step_chunks), strict=True):
                drafts[i].append(tok)
        return drafts

    def _sync(self, seq_id: str, ctx: Sequence[int]) -> int:
        """Roll the draft state of ``seq_id`` back to its longest prefix that still matches
        ``ctx`` (at most ``len(ctx) - 1``: the pending token is always computed now); returns
        that length."""
        fed = self._fed.get(seq_id)
        if not fed:
            return 0
        n = min(len(fed), len(ctx) - 1)
        start = min(self._checked.get(seq_id, 0), n)
        mismatch = next((p for p in range(start, n) if fed[p] != ctx[p]), n)
        if mismatch < len(fed):
            del fed[mismatch:]
            self.kv.truncate(seq_id, mismatch)
        return mismatch

    @torch.inference_mode()
    def _step(self, chunks: list[SeqChunk]) -> list[int]:
        """One draft forward over ``chunks`` (decodes first); the argmax of the last row of
        each chunk that samples, in order."""
        out = self.runner.execute(StepPlan(tuple(chunks), self.block_size))
        return first_argmax(out.sample_logits).tolist() if out.sampled else []
