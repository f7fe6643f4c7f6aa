"""``KVEventRecorder``: the KV cache's hash transitions as vLLM's events, one batch per step.

Engine thread only. The KV side calls thin hooks and knows nothing of events or ZMQ: each block
pool (device, host) and the disk tier hold a :class:`TierHook` for their medium and report every
hash they gain (``stored``) or lose (``removed``); the KV manager reports the tokens and parent of
every block it commits (``describe``, before it is registered) and prefix-cache resets
(``cleared``).

The recorder keeps a catalog ``hash -> (parent, tokens, group)`` of every hash the device or host
pool holds (bounded by the two pools' sizes), so a spilled or disk-written block is published
with its tokens too. Consecutive stores continuing one chain in one medium and group become one
``BlockStored`` (vLLM publishes one per contiguous run), consecutive removals one
``BlockRemoved``. ``take()`` hands out the step's events; the core sends them at the end of every
step, and at once after a reset."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupSpec,
    KVCacheEvent,
)

_Entry = tuple  # (parent hash | None, token ids, group index, (lora_id, lora_name) | None)


class _Run:
    """An event being built: consecutive stores of one chain, or removals, in one medium."""

    __slots__ = ("kind", "medium", "group", "hashes", "parent", "tokens", "lora")

    def __init__(self, kind: str, medium: str, group: int, parent: bytes | None,
                 lora: tuple[int, str] | None = None) -> None:
        self.kind, self.medium, self.group, self.parent = kind, medium, group, parent
        self.lora = lora
        self.hashes: list[bytes] = []
        self.tokens: list[int] = []


class TierHook:
    """What one medium's pool (or tier) calls. ``cached``: the pool's hash map (None for a
    tier the recorder cannot see into, the disk), so the catalog knows what is still held."""

    __slots__ = ("recorder", "medium", "cached")

    def __init__(self, recorder: KVEventRecorder, medium: str, cached: dict | None) -> None:
        self.recorder, self.medium, self.cached = recorder, medium, cached

    def stored(self, block_hash: bytes) -> None:
        self.recorder.stored(self.medium, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self.recorder.removed(self.medium, block_hash)

    def describe(self, block_hash: bytes, parent: bytes | None, tokens: Sequence[int],
                 group: int = 0, keys: tuple = ()) -> None:
        self.recorder.describe(block_hash, parent, tokens, group, keys)

    def describe_chain(self, hashes: Sequence[bytes], token_ids: Sequence[int], start: int,
                       end: int, group: int = 0, keys: tuple = ()) -> None:
        self.recorder.describe_chain(hashes, token_ids, start, end, group, keys)

    def cleared(self) -> None:
        self.recorder.cleared()


class KVEventRecorder:
    """``block_size`` tokens a block; ``groups``: a hybrid cache's groups (None: one group,
    published without group fields); ``on_clear``: called after a reset's events were
    recorded (the core sends them at once)."""

    def __init__(self, block_size: int, groups: Sequence[GroupSpec] | None = None,
                 on_clear: Callable[[], None] | None = None) -> None:
        self.block_size = block_size
        self.groups = tuple(groups) if groups is not None else None
        self.on_clear = on_clear
        self._catalog: dict[bytes, _Entry] = {}
        self._runs: list[_Run | AllBlocksCleared] = []
        self._tiers: list[TierHook] = []
        self.undescribed = 0  # stores of a hash whose tokens were unknown (not published)
        # The LoRA adapter named by a block's extra keys, as (lora_id, lora_name), or None
        # for the base model (set by the engine when LoRA is on: engine.adapters).
        self.lora_of: Callable[[tuple], tuple[int, str] | None] | None = None

    def tier(self, medium: str, cached: dict | None = None) -> TierHook:
        """The hook a pool of ``medium`` (hash map ``cached``) or the disk tier calls."""
        hook = TierHook(self, medium, cached)
        self._tiers.append(hook)
        return hook

    # ---- what the KV side tells ----------------------------------------------------------
    def describe(self, block_hash: bytes, parent: bytes | None, tokens: Sequence[int],
                 group: int = 0, keys: tuple = ()) -> None:
        """``block_hash`` names ``tokens`` after ``parent`` (None: the first block), under the
        request's cache ``keys`` (its LoRA adapter is published with the block)."""
        if block_hash not in self._catalog:
            self._catalog[block_hash] = (parent, tuple(tokens), group, self._lora(keys))

    def describe_chain(self, hashes: Sequence[bytes], token_ids: Sequence[int], start: int,
                       end: int, group: int = 0, keys: tuple = ()) -> None:
        """Blocks ``start .. end - 1`` of the chain ``hashes`` of ``token_ids`` (a prefix hit's
        blocks that a lower tier holds, about to be loaded back)."""
        bs = self.block_size
        lora = self._lora(keys)
        for i in range(start, end):
            if hashes[i] not in self._catalog:
                self._catalog[hashes[i]] = (hashes[i - 1] if i else None,
                                            tuple(token_ids[i * bs:(i + 1) * bs]), group, lora)

    def _lora(self, keys: tuple) -> tuple[int, str] | None:
        return self.lora_of(keys) if keys and self.lora_of is not None else None

    def stored(self, medium: str, block_hash: bytes) -> None:
        entry = self._catalog.get(block_hash)
        if entry is None:
            self.undescribed += 1
            return
        parent, tokens, group, lora = entry
        run = self._runs[-1] if self._runs else None
        if not (isinstance(run, _Run) and run.kind == "stored" and run.medium == medium
                and run.group == group and run.hashes[-1] == parent):
            run = _Run("stored", medium, group, parent, lora)
            self._runs.append(run)
        run.hashes.append(block_hash)
        run.tokens.extend(tokens)

    def removed(self, medium: str, block_hash: bytes) -> None:
        entry = self._catalog.get(block_hash)
        if entry is None:  # never announced
            return
        group = entry[2]
        run = self._runs[-1] if self._runs else None
        if not (isinstance(run, _Run) and run.kind == "removed" and run.medium == medium
                and run.group == group):
            run = _Run("removed", medium, group, None)
            self._runs.append(run)
        run.hashes.append(block_hash)
        if not any(t.cached is not None and block_hash in t.cached for t in self._tiers):
            del self._catalog[block_hash]

    def cleared(self) -> None:
        """The prefix cache was reset: AllBlocksCleared, then a store for every hash a pool
        still holds (blocks in use keep theirs), so a subscriber's view stays exact."""
        self._runs.append(AllBlocksCleared())
        held = [t for t in self._tiers if t.cached is not None]
        self._catalog = {h: e for h, e in self._catalog.items()
                         if any(h in t.cached for t in held)}
        for t in held:
            for h in list(t.cached):
                self.stored(t.medium, h)
        if self.on_clear is not None:
            self.on_clear()

    # ---- what the core takes -------------------------------------------------------------
    @property
    def num_described(self) -> int:
        """Hashes in the catalog (tests: bounded by what the pools hold)."""
        return len(self._catalog)

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order."""
        runs, self._runs = self._runs, []
        return [self._event(r) for r in runs]

    def _event(self, run: _Run | AllBlocksCleared) -> KVCacheEvent:
        if isinstance(run, AllBlocksCleared):
            return run
        group = self.groups[run.group] if self.groups is not None else None
        if run.kind == "removed":
            return BlockRemoved(tuple(run.hashes), run.medium,
                                group.group_idx if group is not None else None)
        lora_id, lora_name = run.lora if run.lora is not None else (None, None)
        return BlockStored(tuple(run.hashes), run.parent, tuple(run.tokens), self.block_size,
                           run.medium, group, lora_id, lora_name)
