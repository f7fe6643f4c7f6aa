"""Which part of each weight a tensor-parallel rank holds: pure arithmetic, no torch.distributed.

Megatron's split of a Llama-family layer over ``N`` ranks: Q/K/V and gate/up column-parallel
(a rank's own heads and slice of the intermediate features, no communication); O and down
row-parallel (partial sums all-reduced, one after O and one after down per layer; their biases
kept by rank 0 only); the token table and the logits head vocabulary-parallel (a contiguous
range of token rows per rank: lookups summed, logits gathered); norms replicated. A
mixture-of-experts layer splits every expert like the dense MLP over its own intermediate
features (``expert_intermediate``), summed by the layer's one all-reduce; its router is
replicated.
Heads follow their KV group: with at least as many KV heads as ranks the KV heads are split
into contiguous, near-even ranges; with fewer, each KV head is replicated on ``N / kv`` ranks,
which split its group's query heads. Sizes that do not divide are split near-evenly
(``size * r // N``). :func:`check_tensor_parallel` says, in a user's terms, when a model cannot
be split."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.models.arch import ModelArch


def even_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s near-even share of ``size`` items (sizes differ by <= 1)."""
    return size * rank // world, size * (rank + 1) // world


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``world`` holds, in units of heads, features and token ids."""

    rank: int
    world: int
    q_heads: tuple[int, int]  # [start, stop) of the query heads
    kv_heads: tuple[int, int]  # [start, stop) of the KV heads (replicated ones included)
    intermediate: tuple[int, int]  # [start, stop) of the MLP features
    vocab: tuple[int, int]  # [start, stop) of the token ids (table and head rows)
    vocab_size: int  # the whole vocabulary
    head_dim: int
    expert_intermediate: tuple[int, int] = (0, 0)  # [start, stop) of each expert's features

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_sizes(self) -> list[int]:
        """Token rows of every rank, in rank order (what a logits gather concatenates)."""
        return [b - a for a, b in (even_range(self.vocab_size, r, self.world)
                                   for r in range(self.world))]

    def weight_slice(self, name: str) -> tuple | str | None:
        """How rank ``rank`` loads the HF tensor ``name``: ``(dim, start, stop)`` to narrow,
        ``(dim, start, stop, "halves")``: that range of each half of ``dim``, concatenated (a
        stacked expert gate/up ``[E, 2I, H]``: gate rows, then up rows),
        ``"zero"`` (a row-parallel bias on ranks > 0: added once, by rank 0) or None (the
        whole tensor: norms, routers)."""
        d = self.head_dim
        leaf = name.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
        if ".experts." in name:
            return self._expert_slice(name, module, kind)
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return (0, *self.vocab)
        if module == "q_proj":
            return (0, self.q_heads[0] * d, self.q_heads[1] * d)
        if module in ("k_proj", "v_proj"):
            return (0, self.kv_heads[0] * d, self.kv_heads[1] * d)
        if module in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return None if self.rank == 0 else "zero"
            span = self.intermediate if module == "down_proj" else (self.q_heads[0] * d,
                                                                    self.q_heads[1] * d)
            return (1, *span)
        return None

    def _expert_slice(self, name: str, module: str, kind: str) -> tuple:
        a, b = self.expert_intermediate
        if kind == "gate_up_proj":  # stacked [E, 2I, H]: gate rows, then up rows
            return (1, a, b, "halves")
        if kind == "down_proj":  # stacked [E, H, I]
            return (2, a, b)
        if module in ("gate_proj", "up_proj", "w1", "w3"):  # per expert [I, H]
            return (0, a, b)
        if module in ("down_proj", "w2"):  # per expert [H, I]
            return (1, a, b)
        raise ValueError(f"unknown expert tensor {name!r}")


def check_tensor_parallel(arch: ModelArch, world: int) -> None:
    """Raise ValueError when ``arch`` cannot be split over ``world`` ranks."""
    h, kv = arch.num_heads, arch.num_kv_heads
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {world}")
    if h < world:
        raise ValueError(f"tensor_parallel_size {world} is larger than the model's {h} "
                         f"attention heads: every rank needs at least one head")
    if kv < world:
        if world % kv:
            raise ValueError(f"tensor_parallel_size {world} must be a multiple of the model's "
                             f"{kv} KV heads (each KV head is replicated on "
                             f"tensor_parallel_size / kv_heads ranks) or at most {kv}")
        if h // kv < world // kv:
            raise ValueError(f"tensor_parallel_size {world}: each KV head's {h // kv} query "
                             f"heads cannot be shared by {world // kv} ranks")
    if arch.intermediate_size < world or arch.vocab_size < world:
        raise ValueError(f"tensor_parallel_size {world} is larger than the model's MLP or "
                         f"vocabulary size")
    if arch.moe is not None and arch.moe.expert_intermediate < world:
        raise ValueError(f"tensor_parallel_size {world} is larger than the experts' "
                         f"{arch.moe.expert_intermediate} intermediate features")


def rank_shard(arch: ModelArch, rank: int, world: int) -> RankShard:
    """The shard of rank ``rank`` (see the module docstring for the split)."""
    check_tensor_parallel(arch, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    h, kv = arch.num_heads, arch.num_kv_heads
    group = h // kv
    if kv >= world:
        kv_range = even_range(kv, rank, world)
        q_range = (kv_range[0] * group, kv_range[1] * group)
    else:
        replicas = world // kv
        head, sub = divmod(rank, replicas)
        kv_range = (head, head + 1)
        a, b = even_range(group, sub, replicas)
        q_range = (head * group + a, head * group + b)
    return RankShard(rank=rank, world=world, q_heads=q_range, kv_heads=kv_range,
                     intermediate=even_range(arch.intermediate_size, rank, world),
                     vocab=even_range(arch.vocab_size, rank, world),
                     vocab_size=arch.vocab_size, head_dim=arch.head_dim,
                     expert_intermediate=(even_range(arch.moe.expert_intermediate, rank, world)
                                          if arch.moe is not None else (0, 0)))


def local_arch(arch: ModelArch, shard: RankShard) -> ModelArch:
    """``arch`` with this rank's head and feature counts (the vocabulary stays whole: the
    engine samples from all of it)."""
    moe = arch.moe
    if moe is not None:
        a, b = shard.expert_intermediate
        moe = dataclasses.replace(moe, expert_intermediate=b - a)
    return dataclasses.replace(arch, num_heads=shard.num_q_heads,
                               num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate[1] - shard.intermediate[0],
                               moe=moe)
