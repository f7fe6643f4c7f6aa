"""Gemma 2 / Gemma 3 config fields a GGUF implies but transformers' GGUF reader drops.

transformers maps a Gemma GGUF's sizes, RoPE base and window onto ``Gemma2Config`` /
``Gemma3TextConfig`` and leaves the rest at the defaults; llama.cpp (``src/llama-model.cpp``)
reads or derives more: Gemma 2's ``attn_logit_softcapping`` and ``final_logit_softcapping``;
the query scale (``query_pre_attn_scalar``: ``head_dim``, or ``hidden / heads`` for the 27B
models, Gemma 2's 46 layers and Gemma 3's 62); Gemma 3's local RoPE base
(``rope.freq_base_swa``, else 10 000), global RoPE scaling (``rope.scaling.type`` /
``.factor``) and, when given, ``attention.sliding_window_pattern``.

:func:`gemma_overrides` returns those as config attributes; ``gguf_convert`` sets them on the
config before it is saved. The tensors need nothing here: transformers' Gemma tensor processor
already subtracts the 1 that llama.cpp's converter adds to every norm weight."""

from __future__ import annotations

from typing import Any

from engine.loading.gguf_fields import gguf_field

_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_overrides(reader, arch: str) -> dict[str, Any]:
    """Config attributes for a ``gemma2`` / ``gemma3`` GGUF (``reader``: a ``GGUFReader``);
    empty for other architectures."""
    if arch not in _27B_LAYERS:
        return {}

    def get(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    wide = int(get("block_count", 0)) == _27B_LAYERS[arch]
    out: dict[str, Any] = {"query_pre_attn_scalar": hidden // heads if wide else head_dim}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
        return out
    full: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        full.update(rope_type=str(scaling), factor=float(get("rope.scaling.factor", 1.0)))
    local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10_000.0))}
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    pattern = get("attention.sliding_window_pattern")
    layers = int(get("block_count"))
    if isinstance(pattern, int) and pattern > 0:
        out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(layers)]
    elif isinstance(pattern, list) and len(pattern) == layers:
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    return out
