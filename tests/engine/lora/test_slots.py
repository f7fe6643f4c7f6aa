"""LoRASlots: at most max_loras resident, LRU among idle slots, a pinned adapter never evicted,
ids never reused, an unloaded adapter kept until its last sequence releases it."""

from __future__ import annotations

import pytest
import torch

from engine.lora.adapter import LoRAAdapter
from engine.lora.slots import LoRASlots


def _adapter(name: str, rank: int = 2, seed: int = 0) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoRAAdapter(name, "mem", rank, 1.0,
                       {(0, "q_proj"): (torch.randn(rank, 8, generator=g),
                                        torch.randn(8, rank, generator=g))})


def _slots(max_loras: int, max_rank: int = 8):
    placed: list[tuple[int, str | None]] = []
    slots = LoRASlots(max_loras, max_rank,
                      lambda i, a: placed.append((i, None if a is None else a.name)))
    return slots, placed


def test_lru_among_idle_and_pinned_never_evicted():
    slots, placed = _slots(2)
    a, b, c = (slots.add(_adapter(n)) for n in "abc")
    sa = slots.acquire(a)
    sb = slots.acquire(b)
    assert {sa, sb} == {0, 1} and slots.num_loads == 2
    assert slots.acquire(c) is None  # both pinned: c waits
    slots.release(sb)
    slots.release(sa)  # a released last: b is the least recently used idle slot
    sc = slots.acquire(c)
    assert sc == sb and placed[-2:] == [(sb, None), (sb, "c")]
    assert slots.acquire(a) == sa  # still resident: no load
    assert slots.num_loads == 3


def test_reacquire_resident_counts_pins():
    slots, _ = _slots(1)
    a = slots.add(_adapter("a"))
    s = slots.acquire(a)
    assert slots.acquire(a) == s
    slots.release(s)
    assert slots.resident() == [(s, a, 1)]
    slots.release(s)
    with pytest.raises(RuntimeError):
        slots.release(s)


def test_remove_while_running_keeps_weights_until_released():
    slots, placed = _slots(2)
    a = slots.add(_adapter("a"))
    s = slots.acquire(a)
    slots.remove("a")
    assert slots.id_of("a") is None and slots.names() == []
    assert slots.adapter(a).name == "a"  # the running sequence's weights stay
    a2 = slots.add(_adapter("a", seed=1))  # the name again: a new id, a new slot
    assert a2 != a
    assert slots.acquire(a2) != s
    slots.release(s)
    assert (s, None) in placed  # cleared with its last release
    with pytest.raises(KeyError):
        slots.adapter(a)


def test_refusals():
    slots, _ = _slots(1, max_rank=2)
    slots.add(_adapter("a"))
    with pytest.raises(ValueError, match="already loaded"):
        slots.add(_adapter("a"))
    with pytest.raises(ValueError, match="max-lora-rank"):
        slots.add(_adapter("big", rank=4))
    with pytest.raises(KeyError):
        slots.remove("nope")
    with pytest.raises(ValueError):
        LoRASlots(0, 8, lambda i, a: None)
