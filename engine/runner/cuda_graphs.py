"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

At small batches the GPU waits on the CPU that launches a decode step's kernels; capturing the
model's forward once per bucket of batch sizes and replaying it costs one launch per step.
``DecodeGraphs.run``: only pure decode steps (one new token per sequence, no prompt logits) of
at most ``max(sizes)`` sequences and ``max_blocks`` blocks each are replayed, anything else runs
eagerly; the batch is padded to the smallest bucket that holds it (padding rows: token 0 at
position 0, slot -1, ``seq_len`` 0, touching neither the KV pool nor the real rows); every input
lives in one static device buffer of a layout fixed per engine, filled from a pinned host mirror
in one asynchronous copy (the block table of fixed width ``ceil(max_model_len / block_size)``,
a fixed decode split count per bucket); graphs share one memory pool and are captured largest
first, their outputs views into it, valid until the next replay.
The bookkeeping (buckets, layout, padding) is plain tensor code that also runs without CUDA
(``capture=False`` replays nothing and runs the padded static batch eagerly), so the CPU tests
check that a padded static step gives the same tokens as the eager one."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.runner.batch import ModelInput

logger = logging.getLogger("kvserve.engine")

# vLLM's shape: fine steps at small batches, where one more padded row costs most.
_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128, 144, 160, 176,
          192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512)


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """The batch sizes to capture: the standard buckets up to ``min(max_num_seqs, limit)``,
    plus that cap itself, so every decode batch the scheduler may form has a bucket."""
    cap = max(1, min(max_num_seqs, limit))
    sizes = [s for s in _SIZES if s < cap]
    return [*sizes, cap]


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest size in ``sizes`` (sorted) that holds ``batch``; None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class _Layout:
    """Offsets (in int32 words) of the fields inside the flat static buffer."""

    max_batch: int
    max_blocks: int

    @property
    def ids(self) -> int:
        return 0

    @property
    def positions(self) -> int:
        return 2 * self.max_batch

    @property
    def slots(self) -> int:
        return 4 * self.max_batch

    @property
    def seq_lens(self) -> int:
        return 6 * self.max_batch

    @property
    def cu_seqlens(self) -> int:
        return 7 * self.max_batch

    @property
    def tables(self) -> int:
        return _align(8 * self.max_batch + 1)

    def words(self, batch: int) -> int:
        """Words to copy for a step of ``batch`` rows: every scalar field, ``batch`` table rows."""
        return self.tables + batch * self.max_blocks


def _align(words: int, to: int = 4) -> int:
    return -(-words // to) * to


@dataclass
class _Captured:
    size: int
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor | None  # the graph's output [size, hidden]


class DecodeGraphs:
    """Captured decode forwards for ``sizes`` on one device.

    ``forward(input_ids, positions, meta) -> hidden`` is the model's forward with the KV pools
    and backend bound. ``num_splits(batch) -> int`` fixes the decode kernel's split count per
    bucket. The KV pools must not be reallocated after :meth:`capture`.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                         torch.Tensor],
                 device: torch.device, sizes: list[int], block_size: int, max_model_len: int,
                 num_splits: Callable[[int], int] | None = None) -> None:
        self.forward = forward
        self.device = device
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.layout = _Layout(max(self.sizes), -(-max_model_len // block_size))
        words = self.layout.words(self.layout.max_batch)
        self._static = torch.zeros(words, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(words, dtype=torch.int32, pin_memory=pin)
        self._copied: torch.cuda.Event | None = None
        self._num_splits = num_splits
        lay = self.layout
        # cu_seqlens_q is 0, 1, ..., max_batch for every bucket: written once, in both copies
        # (every step's copy carries the mirror's over the static one).
        for buf in (self._static, self._host):
            self._field(buf, lay.cu_seqlens, lay.max_batch + 1, torch.int32).copy_(
                torch.arange(lay.max_batch + 1, dtype=torch.int32))
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self.captured = False

    # ---- static buffers -------------------------------------------------------------------

    @staticmethod
    def _field(buf: torch.Tensor, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        words = n * (torch.tensor([], dtype=dtype).element_size() // 4)
        return buf[offset:offset + words].view(dtype)

    def _views(self, buf: torch.Tensor, size: int) -> dict[str, torch.Tensor]:
        lay = self.layout
        return {
            "ids": self._field(buf, lay.ids, size, torch.int64),
            "positions": self._field(buf, lay.positions, size, torch.int64),
            "slots": self._field(buf, lay.slots, size, torch.int64),
            "seq_lens": self._field(buf, lay.seq_lens, size, torch.int32),
            "cu": self._field(buf, lay.cu_seqlens, size + 1, torch.int32),
            "tables": buf[lay.tables:lay.tables + size * lay.max_blocks].view(
                size, lay.max_blocks),
        }

    def _meta(self, size: int) -> AttentionMetadata:
        v = self._views(self._static, size)
        splits = self._num_splits(size) if self._num_splits is not None else None
        return AttentionMetadata(
            slot_mapping=v["slots"], cu_seqlens_q=v["cu"], seq_lens=v["seq_lens"],
            block_tables=v["tables"], block_size=self.block_size, max_query_len=1,
            max_seq_len=self.max_model_len, num_decodes=size, num_decode_tokens=size,
            query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size,
            all_slots_valid=False, decode_num_splits=splits)

    # ---- capture --------------------------------------------------------------------------

    def capture(self, use_graphs: bool = True) -> None:
        """Warm up (compiling every kernel variant a bucket launches) and, with
        ``use_graphs`` on CUDA, capture each bucket, largest first, into one memory pool.

        Without graphs the buckets are still prepared, so :meth:`run` pads and runs eagerly:
        the same arithmetic as a replay, checked by the CPU tests."""
        graphs = use_graphs and self.device.type == "cuda"
        for size in sorted(self.sizes, reverse=True):
            meta = self._meta(size)
            v = self._views(self._static, size)
            v["slots"].fill_(-1)  # warm-up and capture write no KV
            v["seq_lens"].zero_()
            with torch.inference_mode():
                self.forward(v["ids"], v["positions"], meta)  # compiles the kernels
                if not graphs:
                    self._graphs[size] = _Captured(size, meta, None, None)
                    continue
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    hidden = self.forward(v["ids"], v["positions"], meta)
                self._pool = graph.pool()
            self._graphs[size] = _Captured(size, meta, graph, hidden)
        if graphs:
            torch.cuda.synchronize(self.device)
        self.captured = graphs

    # ---- replay ---------------------------------------------------------------------------

    def can_run(self, inp: ModelInput) -> bool:
        return (bool(self._graphs) and inp.is_pure_decode and not inp.lora_slots
                and inp.num_seqs <= self.layout.max_batch
                and inp.block_tables.shape[1] <= self.layout.max_blocks)

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a pure decode step (``can_run(inp)`` must hold);
        a view valid until the next call."""
        b = inp.num_seqs
        size = bucket_for(b, self.sizes)
        assert size is not None and self.can_run(inp)
        cap = self._graphs[size]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host mirror
        v = self._views(self._host, size)
        v["ids"][:b].copy_(inp.input_ids)
        v["ids"][b:].zero_()
        v["positions"][:b].copy_(inp.positions)
        v["positions"][b:].zero_()
        v["slots"][:b].copy_(inp.slot_mapping)
        v["slots"][b:].fill_(-1)
        v["seq_lens"][:b].copy_(inp.seq_lens)
        v["seq_lens"][b:].zero_()
        width = inp.block_tables.shape[1]
        v["tables"][:b, :width].copy_(inp.block_tables)
        words = self.layout.words(size)
        self._static[:words].copy_(self._host[:words], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if cap.graph is None:
            s = self._views(self._static, size)
            with torch.inference_mode():
                return self.forward(s["ids"], s["positions"], cap.meta)[:b]
        cap.graph.replay()
        return cap.hidden[:b]
