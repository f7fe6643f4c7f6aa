"""LoRAWeights.apply against the plain formula, per row's adapter: the matmul path and the C++
kernel (``cpu-kernel``: a row's delta bit for bit the same at any row count), and LoRABatch's
grouping of rows by slot."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from engine.lora.adapter import LoRAAdapter
from engine.lora.batch import LoRABatch
from engine.lora.weights import LoRAWeights, ModuleShape

H, Q, KV = 32, 32, 16
SHAPES = {(0, "qkv_proj"): ModuleShape(H, (Q, KV, KV)), (0, "o_proj"): ModuleShape(Q, (H,))}


def _adapter(name: str, seed: int, targets: dict[str, tuple[int, int]], rank: int = 4):
    g = torch.Generator().manual_seed(seed)
    w = {(0, t): (torch.randn(rank, fan_in, generator=g), torch.randn(out, rank, generator=g))
         for t, (fan_in, out) in targets.items()}
    return LoRAAdapter(name, "mem", rank, 0.5, w)


ADAPTERS = [_adapter("qv", 1, {"q_proj": (H, Q), "v_proj": (H, KV)}),
            _adapter("all", 2, {"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV),
                                "o_proj": (Q, H)}, rank=3)]
OFFSETS = {"q_proj": 0, "k_proj": Q, "v_proj": Q + KV}


def _expected_delta(adapter: LoRAAdapter, module: str, x: torch.Tensor, out_dim: int):
    delta = torch.zeros(x.shape[0], out_dim)
    for (_, target), (a, b) in adapter.weights.items():
        if module == "qkv_proj" and target in OFFSETS:
            off, size = OFFSETS[target], b.shape[0]
            delta[:, off:off + size] += adapter.scaling * (x @ a.t()) @ b.t()
        elif module == "o_proj" and target == "o_proj":
            delta += adapter.scaling * (x @ a.t()) @ b.t()
    return delta


def _weights(kind: str, max_loras: int, max_rank: int) -> LoRAWeights:
    if kind == "cpu-kernel" and load() is None:
        pytest.skip("the C++ kernels are not built here")
    w = LoRAWeights(SHAPES, max_loras, max_rank, torch.device("cpu"), torch.float32, kind)
    assert w.kind == kind
    return w


@pytest.mark.parametrize("kind", ["matmul", "cpu-kernel"])
def test_apply_matches_formula_per_row(kind):
    w = _weights(kind, 3, 4)
    w.place(0, ADAPTERS[0])
    w.place(2, ADAPTERS[1])
    seq_slots, q_lens = [2, -1, 0, 2, 0], [1, 3, 2, 4, 1]  # slot 2 in two runs: an index
    w.batch = LoRABatch.build(seq_slots, q_lens, torch.device("cpu"), row_slots=w.stacked)
    x = torch.randn(sum(q_lens), H)
    for module, out_dim in (("qkv_proj", Q + 2 * KV), ("o_proj", H)):
        base = torch.randn(x.shape[0], out_dim)
        out = base.clone()
        w.apply(0, module, x, out)
        row = 0
        for slot, n in zip(seq_slots, q_lens):
            want = base[row:row + n]
            if slot >= 0:
                adapter = ADAPTERS[0] if slot == 0 else ADAPTERS[1]
                want = want + _expected_delta(adapter, module, x[row:row + n], out_dim)
            torch.testing.assert_close(out[row:row + n], want, rtol=1e-5, atol=1e-5)
            row += n


def test_kernel_gives_a_row_the_same_delta_at_any_row_count():
    w = _weights("cpu-kernel", 2, 4)
    w.place(1, ADAPTERS[1])
    x = torch.randn(40, H)
    w.batch = LoRABatch.build([1], [40], torch.device("cpu"), row_slots=True)
    full = torch.zeros(40, Q + 2 * KV)
    w.apply(0, "qkv_proj", x, full)
    for m in (1, 2, 3, 7, 16, 33):
        w.batch = LoRABatch.build([1, -1], [m, 3], torch.device("cpu"), row_slots=True)
        part = torch.zeros(m + 3, Q + 2 * KV)
        w.apply(0, "qkv_proj", torch.cat([x[:m], torch.randn(3, H)]), part)
        assert torch.equal(part[:m], full[:m]), m
        assert torch.equal(part[m:], torch.zeros(3, Q + 2 * KV))


def test_batch_groups_and_clearing():
    assert LoRABatch.build([-1, -1], [3, 1], torch.device("cpu")) is None
    b = LoRABatch.build([1, 1, -1, 0, 1], [2, 1, 4, 1, 2], torch.device("cpu"), row_slots=True)
    groups = dict(b.groups)
    assert groups[0] == slice(7, 8)
    assert groups[1].tolist() == [0, 1, 2, 8, 9]  # two runs of slot 1
    assert b.row_slots.tolist() == [1, 1, 1, -1, -1, -1, -1, 0, 1, 1]
    w = LoRAWeights(SHAPES, 1, 4, torch.device("cpu"), torch.float32)
    w.place(0, ADAPTERS[0])
    w.place(0, None)
    w.batch = LoRABatch.build([0], [2], torch.device("cpu"), row_slots=True)
    out = torch.zeros(2, Q + 2 * KV)
    w.apply(0, "qkv_proj", torch.randn(2, H), out)
    assert torch.equal(out, torch.zeros_like(out))  # an emptied slot adds nothing


def test_check_names_the_mismatch():
    w = LoRAWeights(SHAPES, 1, 2, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="another base model"):
        w.check(_adapter("x", 0, {"q_proj": (H + 1, Q)}, rank=2))
    with pytest.raises(ValueError, match="does not have"):
        w.check(_adapter("x", 0, {"gate_proj": (H, 8)}, rank=2))
    with pytest.raises(ValueError, match="max-lora-rank"):
        w.check(_adapter("x", 0, {"q_proj": (H, Q)}, rank=4))
