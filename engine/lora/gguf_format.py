"""Reading a llama.cpp LoRA adapter GGUF (what llama.cpp's ``convert_lora_to_gguf.py`` writes).

The file says ``general.type = "adapter"``, ``adapter.type = "lora"`` and ``adapter.lora.alpha``
and holds, per decoder layer ``N`` and projection (``attn_q``, ``attn_k``, ``attn_v``,
``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down``), ``blk.N.<proj>.weight.lora_a`` and
``.lora_b``. Layout, as the converter writes it:

* no transpose relative to PEFT: ``lora_a`` is PEFT's A ``[r, in]`` (GGUF ``ne = [in, r]``),
  ``lora_b`` is PEFT's B ``[out, r]`` (``ne = [r, out]``); ``GGUFReader`` hands both back in
  the PEFT (numpy) order;
* for ``general.architecture`` llama (Llama, Mistral and Mixtral files all say llama) the
  converter permutes the rows of Q and K as it permutes base weights for llama.cpp's rotary
  layout; for a LoRA pair only B's rows move (A is untouched). We undo it on the ``lora_b`` of
  ``attn_q`` (``num_heads``) and ``attn_k`` (``num_kv_heads``), as the base-model loader does;
* one alpha for the whole file; llama.cpp scales each pair by ``alpha / r`` with ``r`` that
  pair's rank, or by 1.0 when alpha is 0 or absent. When the pairs' ranks differ, ``scaling``
  is 1.0 and each B carries its own scale (as in ``peft_format``).

Tensor types: F32, F16, BF16 and Q8_0 (the converter's ``--outtype`` choices) are
dequantised to float32 with ``gguf.quants``; others are refused. Also refused: another file
type, aLoRA (``adapter.alora.invocation_tokens``), tensors on anything but the seven
projections (token embeddings, output head, MoE experts, the norms mergekit adds, which
llama.cpp skips), and an ``a`` without its ``b``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.lora.adapter import TARGETS, LoRAAdapter

# llama.cpp tensor names of the seven projections.
GGUF_TARGETS: dict[str, str] = {
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Architectures whose Q/K rows llama.cpp's converter permutes (as the base loader undoes).
PERMUTED_ARCHS = ("llama", "mistral")
_TYPES = ("F32", "F16", "BF16", "Q8_0")


def read_gguf_lora(name: str, path: Path, *, num_heads: int, num_kv_heads: int) -> LoRAAdapter:
    """The LoRA adapter in GGUF file ``path``, served under ``name``, with the base model's
    head counts for undoing the Q/K row permutation (module docstring). ValueError for a
    file kvserve cannot serve exactly, naming the file and the reason."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no such file {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # not a GGUF file, truncated, ...
        raise ValueError(f"LoRA adapter {name!r}: cannot read {path} as GGUF: {e}") from e
    where = f"LoRA adapter {name!r} ({path})"
    kind, adapter_type = field(reader, "general.type"), field(reader, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise ValueError(f"{where} is not a llama.cpp LoRA adapter (general.type {kind!r}, "
                         f"adapter.type {adapter_type!r}; expected 'adapter' and 'lora'): "
                         "convert a PEFT adapter with llama.cpp's convert_lora_to_gguf.py, or "
                         "pass the PEFT directory itself")
    if field(reader, "adapter.alora.invocation_tokens"):
        raise ValueError(f"{where} is an activated LoRA (adapter.alora.invocation_tokens), "
                         "which kvserve does not serve")
    arch = field(reader, "general.architecture")
    halves = read_halves(where, reader)
    alpha = float(field(reader, "adapter.lora.alpha") or 0.0)
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), found in sorted(halves.items()):
        if set(found) != {"a", "b"}:
            have, lack = ("a", "b") if "a" in found else ("b", "a")
            raise ValueError(f"{where}: blk.{layer}.{proj}.weight has lora_{have} but no "
                             f"lora_{lack}; the file is incomplete")
        a, b = found["a"], found["b"]
        if arch in PERMUTED_ARCHS and proj in ("attn_q", "attn_k"):
            heads = num_heads if proj == "attn_q" else num_kv_heads
            if heads <= 0 or b.shape[0] % (2 * heads):
                raise ValueError(f"{where}: blk.{layer}.{proj} lora_b has {b.shape[0]} rows, "
                                 f"which do not split into {heads} heads of rotary halves; "
                                 "was it made for this base model?")
            b = b[unpermute_rows(b.shape[0], heads)].contiguous()
        pairs[(layer, GGUF_TARGETS[proj])] = (a, b)
    scales = {key: (alpha / a.shape[0] if alpha else 1.0) for key, (a, _) in pairs.items()}
    distinct = set(scales.values())
    if len(distinct) == 1:
        scaling, weights = distinct.pop(), pairs
    else:  # ranks differ: fold each pair's scale into its B
        scaling = 1.0
        weights = {key: (a, b * scales[key]) for key, (a, b) in pairs.items()}
    base = field(reader, "general.base_model.0.repo_url") or field(
        reader, "general.base_model.0.name")
    return LoRAAdapter(name=name, path=str(path), rank=max(a.shape[0] for a, _ in pairs.values()),
                       scaling=float(scaling), weights=weights,
                       base_model=str(base) if base else None)


def field(reader, key: str) -> Any:
    """The metadata value under ``key`` (str, number or list), None when absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_halves(where: str, reader) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, GGUF projection) -> {"a": A, "b": B} in float32, PEFT order; ValueError for
    a tensor that is not a served LoRA factor or of a type kvserve does not read."""
    import gguf

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if (len(parts) != 5 or parts[0] != "blk" or not parts[1].isdigit()
                or parts[2] not in GGUF_TARGETS or parts[3] != "weight"
                or parts[4] not in ("lora_a", "lora_b")):
            unknown.append(tensor.name)
            continue
        qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        if qtype.name not in _TYPES:
            raise ValueError(f"{where}: {tensor.name} is {qtype.name}; kvserve reads LoRA "
                             f"tensors of {', '.join(_TYPES)} (convert_lora_to_gguf.py "
                             "--outtype f32, f16, bf16 or q8_0)")
        shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists innermost first
        if len(shape) != 2:
            raise ValueError(f"{where}: {tensor.name} has shape {shape}; LoRA factors are "
                             "matrices")
        values = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
        t = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        halves.setdefault((int(parts[1]), parts[2]), {})[parts[4][-1]] = t
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more"
                                          if len(unknown) > 4 else "")
        raise ValueError(f"{where} holds tensors kvserve cannot serve ({shown}); kvserve serves "
                         "LoRA pairs (blk.N.<proj>.weight.lora_a / .lora_b) on "
                         f"{', '.join(GGUF_TARGETS)} ({', '.join(TARGETS)}) only")
    if not halves:
        raise ValueError(f"{where} has no LoRA tensors")
    return halves


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row indices ``r`` with ``hf[i] = gguf[r[i]]`` for llama.cpp's rotary permutation of a
    Q (``n_head`` heads) or K (``n_head`` = KV heads) projection of ``n_rows`` rows."""
    idx = np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1)
    return torch.from_numpy(np.ascontiguousarray(idx.reshape(n_rows)))
