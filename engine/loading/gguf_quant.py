"""Read a GGUF file's quantised linears as packed weights under Hugging Face names.

The rest of loading goes through the converted HF directory (engine.loading.gguf_convert),
which holds every tensor dequantised. With ``quantization="auto"`` the engine also calls
:func:`read_packed` and keeps the tensors of a supported block type (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K; ``engine.quantization.gguf_blocks``) packed.

Contract of :func:`read_packed`: returns ``{hf_name: Packed}`` for the 2-D tensors of the
decoder (q/k/v/o, gate/up/down, token embedding, output head) stored in a supported type,
and each expert of a stacked expert tensor (engine.loading.gguf_moe.expert_packs);
every other tensor is absent (the caller keeps its float copy). Rows are in Hugging Face order:
llama.cpp's converter permutes the rows of Q and K for rotary embeddings in llama/mistral
files, and this undoes it exactly as transformers' GGUF reader does (a row permutation, so the
packed groups move whole). :func:`gguf_source` finds the GGUF a converted directory came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from engine.loading import gguf_convert
from engine.loading.gguf_fields import gguf_field, gguf_reader
from engine.loading.gguf_moe import expert_packs
from engine.loading.packed_policy import hf_name, is_packable
from engine.quantization.formats import Packed
from engine.quantization.gguf_blocks import from_gguf_blocks

logger = logging.getLogger("kvserve.loader")

_PERMUTED_ARCHS = ("llama", "mistral")  # transformers reverse-permutes Q/K for these only


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from (its marker names it), or None."""
    marker = Path(model_dir) / gguf_convert.MARKER
    try:
        source = Path(json.loads(marker.read_text())["source"])
    except (OSError, ValueError, KeyError):
        return None
    return source if gguf_convert.is_gguf_file(source) else None


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row indices ``r`` with ``hf[i] = gguf[r[i]]`` for llama.cpp's rotary permutation of a
    Q (``n_head`` heads) or K (``n_head`` = KV heads) projection of ``n_rows`` rows."""
    idx = np.arange(n_rows)
    idx = idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)
    return torch.from_numpy(np.ascontiguousarray(idx))


def read_packed(path: Path) -> dict[str, Packed]:
    """Supported quantised linears of ``path`` as packed weights (see the module contract)."""

    reader = gguf_reader(path)
    arch = gguf_field(reader, "general.architecture")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv") or heads
    out: dict[str, Packed] = {}
    for tensor in reader.tensors:
        experts = expert_packs(tensor)  # mixture-of-experts: one packed weight per expert
        if experts is not None:
            out.update(experts)
            continue
        if not is_packable(tensor):
            continue
        name = hf_name(tensor.name)
        k, n = (int(s) for s in tensor.shape)  # GGUF lists the innermost dimension first
        packed = from_gguf_blocks(np.asarray(tensor.data), int(tensor.tensor_type), (n, k))
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            packed = packed.take_rows(unpermute_rows(n, heads if "q_proj" in name else kv_heads))
        out[name] = packed
    logger.info("%s: %d tensors kept packed (%s)", path.name, len(out), arch)
    return out

