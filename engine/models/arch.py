"""The shape of a Llama-family model, read from its HF ``config.json``.

One frozen dataclass covers Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in a few
switches (QKV bias, q/k RMSNorm, sliding window, RoPE scaling, explicit head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters. ``rope_type`` is default | linear | llama3."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: Any) -> RopeSpec:
        # transformers >= 5 keeps everything in rope_parameters; older versions split
        # rope_theta and rope_scaling.
        params = dict(_get(config, "rope_parameters") or {})
        scaling = _get(config, "rope_scaling") or {}
        if isinstance(scaling, dict):
            for k, v in scaling.items():
                params.setdefault(k, v)
        theta = params.get("rope_theta", _get(config, "rope_theta", 10000.0)) or 10000.0
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; kvserve supports "
                             "default, linear and llama3")
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0) or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeSpec
    # Per-layer sliding window (None = full attention on that layer).
    sliding_windows: tuple[int | None, ...]
    hidden_act: str = "silu"

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        model_type = _get(config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r}; kvserve runs "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        kv_heads = int(_get(config, "num_key_value_heads") or heads)
        head_dim = int(_get(config, "head_dim") or hidden // heads)
        layers = int(_get(config, "num_hidden_layers"))
        act = _get(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}; kvserve supports silu")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        windows = _sliding_windows(config, model_type, layers)
        attention_bias = bool(_get(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(_get(config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_get(config, "intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(_get(config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; the others follow attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(_get(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=RopeSpec.from_config(config),
            sliding_windows=windows,
            hidden_act="silu",
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def num_non_embedding_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return self.num_layers * per_layer + h


def _sliding_windows(config: Any, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = _get(config, "sliding_window")
    layer_types = _get(config, "layer_types")
    if model_type in ("qwen2", "qwen3"):
        if not _get(config, "use_sliding_window", False) or not window:
            return (None,) * layers
    if not window:
        return (None,) * layers
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * layers
