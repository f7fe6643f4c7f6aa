"""What Gemma 2 and Gemma 3 add to :class:`engine.models.arch.ModelArch`, read from the HF config.

Light on purpose (no torch), like ``arch``: ``kvserve kv-calc`` imports it.

- ``gemma2`` (``Gemma2ForCausalLM``), ``gemma3_text`` (``Gemma3ForCausalLM``) and ``gemma3``
  (``Gemma3ForConditionalGeneration``, whose ``text_config`` is read: only the text model runs).
- Per-layer-type RoPE: transformers >= 5 keeps Gemma 3's in ``rope_parameters`` keyed by layer
  type (``full_attention`` / ``sliding_attention``); older configs give ``rope_theta`` (global),
  ``rope_local_base_freq`` (local) and ``rope_scaling`` (global layers only). Gemma 2 has one
  RoPE for every layer.
- Query scaling ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``), attention-logit
  and final-logit soft-capping (Gemma 2; ``None`` = off), embeddings scaled by ``sqrt(hidden)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def text_config(config: Any) -> Any:
    """The config of the text model: ``text_config`` for the multimodal ``gemma3``, else itself."""
    if _get(config, "model_type") == "gemma3":
        inner = _get(config, "text_config")
        if inner is None:
            raise ValueError("a gemma3 (Gemma3ForConditionalGeneration) config needs a "
                             "text_config")
        return inner
    return config


def gemma_fields(config: Any, rope_spec: Callable[[Any], Any]) -> dict[str, Any]:
    """The Gemma-only :class:`ModelArch` fields of a (text) config: ``rope``, ``rope_local``,
    ``query_scale``, ``attn_softcap``, ``final_softcap``, ``embed_scale``, ``hidden_act``.
    ``rope_spec`` is ``RopeSpec.from_config`` (passed in: ``arch`` imports this module).
    Raises ValueError for an activation or RoPE type kvserve does not run."""
    act = _get(config, "hidden_activation") or _get(config, "hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"unsupported Gemma activation {act!r}; kvserve supports "
                         f"{', '.join(GEMMA_ACTIVATIONS)}")
    params = _get(config, "rope_parameters") or {}
    if isinstance(params, dict) and "full_attention" in params:  # transformers >= 5, Gemma 3
        rope = rope_spec({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {"rope_theta": 10000.0}
        rope_local = rope_spec({"rope_parameters": local})
    else:
        rope = rope_spec(config)
        local_base = _get(config, "rope_local_base_freq")
        rope_local = None if local_base is None else rope_spec({"rope_theta": local_base})
    hidden = int(_get(config, "hidden_size"))
    head_dim = int(_get(config, "head_dim") or hidden // int(_get(config, "num_attention_heads")))
    scalar = _get(config, "query_pre_attn_scalar") or head_dim
    if float(scalar) <= 0:
        raise ValueError(f"query_pre_attn_scalar must be positive; got {scalar!r}")

    def cap(name: str) -> float | None:
        value = _get(config, name)
        return float(value) if value else None

    return dict(rope=rope, rope_local=rope_local, query_scale=float(scalar) ** -0.5,
                attn_softcap=cap("attn_logit_softcapping"),
                final_softcap=cap("final_logit_softcapping"), embed_scale=hidden ** 0.5,
                hidden_act=act)
