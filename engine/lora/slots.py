"""Which adapters are known, and which sit in the device's ``max_loras`` slots.

The engine thread alone drives a :class:`LoRASlots`. Known adapters (``add``) stay on the CPU;
a running sequence of an adapter holds a pin on the slot it sits in (``acquire`` /
``release``). An adapter not resident is placed in a free slot, else in the least recently
released idle slot (LRU among idle ones); an adapter in use is never evicted, so ``acquire``
answers None while every slot is pinned by other adapters, and the sequence waits.

Each ``add`` gets a new ``lora_id`` (1, 2, ...; 0 is the base model), also when a name is
loaded again after ``remove``: slots are keyed by id, so a sequence still running on an
unloaded adapter keeps its weights until it ends, while new requests see the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.adapter import LoRAAdapter


@dataclass
class _Slot:
    lora_id: int = 0  # 0: empty
    pins: int = 0
    last_release: int = 0  # LRU order among idle slots


class LoRASlots:
    """Adapter registry and slot residency (module docstring). ``place(slot, adapter)`` writes
    an adapter's weights into a slot (``None``: clear it); it is called on the engine thread
    between steps."""

    def __init__(self, max_loras: int, max_rank: int,
                 place: Callable[[int, LoRAAdapter | None], None]) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {max_loras}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._place = place
        self._by_name: dict[str, int] = {}
        self._adapters: dict[int, LoRAAdapter] = {}  # known and still-running unloaded ones
        self._slots = [_Slot() for _ in range(max_loras)]
        self._next_id = 1
        self._clock = 0
        self.num_loads = 0  # adapters placed into a slot (a miss of the resident set)

    # ---- the registry ----------------------------------------------------------------------

    def add(self, adapter: LoRAAdapter) -> int:
        """Register ``adapter`` under its name; returns its lora_id. ValueError for a name
        already loaded or a rank above ``max_rank``."""
        if adapter.name in self._by_name:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above "
                             f"--max-lora-rank {self.max_rank}")
        lora_id = self._next_id
        self._next_id += 1
        self._by_name[adapter.name] = lora_id
        self._adapters[lora_id] = adapter
        return lora_id

    def remove(self, name: str) -> None:
        """Forget ``name`` (KeyError if unknown). Its slot is cleared now when idle, else when
        its last running sequence releases it."""
        lora_id = self._by_name.pop(name)
        for i, slot in enumerate(self._slots):
            if slot.lora_id == lora_id:
                if slot.pins == 0:
                    self._clear(i)
                return
        del self._adapters[lora_id]

    def id_of(self, name: str) -> int | None:
        return self._by_name.get(name)

    def adapter(self, lora_id: int) -> LoRAAdapter:
        return self._adapters[lora_id]

    def names(self) -> list[str]:
        return list(self._by_name)

    def loaded(self) -> list[tuple[int, LoRAAdapter]]:
        """(lora_id, adapter) of every known name, in load order."""
        return [(i, self._adapters[i]) for i in self._by_name.values()]

    # ---- residency --------------------------------------------------------------------------

    def acquire(self, lora_id: int) -> int | None:
        """Pin ``lora_id``'s slot (placing it first when it is not resident); None when every
        slot is pinned by other adapters."""
        free = idle = None
        for i, slot in enumerate(self._slots):
            if slot.lora_id == lora_id:
                slot.pins += 1
                return i
            if slot.lora_id == 0:
                free = i if free is None else free
            elif slot.pins == 0 and (idle is None
                                     or slot.last_release < self._slots[idle].last_release):
                idle = i
        target = free if free is not None else idle
        if target is None:
            return None
        if self._slots[target].lora_id:
            self._clear(target)
        self._place(target, self._adapters[lora_id])
        self.num_loads += 1
        self._slots[target] = _Slot(lora_id, 1, 0)
        return target

    def release(self, slot_index: int) -> None:
        """Drop one pin of ``slot_index``; an unloaded adapter's slot is cleared with its last."""
        slot = self._slots[slot_index]
        if slot.pins <= 0:
            raise RuntimeError(f"LoRA slot {slot_index} released more often than acquired")
        slot.pins -= 1
        self._clock += 1
        slot.last_release = self._clock
        if slot.pins == 0 and slot.lora_id not in self._by_name.values():
            self._clear(slot_index)

    def _clear(self, slot_index: int) -> None:
        lora_id = self._slots[slot_index].lora_id
        self._place(slot_index, None)
        self._slots[slot_index] = _Slot()
        if lora_id not in self._by_name.values():
            self._adapters.pop(lora_id, None)

    def resident(self) -> list[tuple[int, int, int]]:
        """(slot, lora_id, pins) of every occupied slot."""
        return [(i, s.lora_id, s.pins) for i, s in enumerate(self._slots) if s.lora_id]
