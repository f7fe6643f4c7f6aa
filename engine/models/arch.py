"""The shape of a model, read from its HF ``config.json`` in ONE place.

:func:`shape_from_hf_config` is the only reader of the sizes (layers, heads, KV heads, head dim,
hidden, intermediate, vocabulary, context) from a Hugging Face config; it gives a
:class:`ModelShape`, which ``kv-calc``, the FLOPs yardstick and :class:`ModelArch` share (a GGUF
file's metadata is mapped onto the same config keys by ``loadgen.kv_calc.shape_from_gguf``).

:class:`ModelArch` adds what running the model needs to that shape. One frozen dataclass covers
Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in a few switches (QKV bias, q/k RMSNorm,
sliding window, RoPE scaling, explicit head_dim).

Light on purpose (no torch): ``kvserve kv-calc`` imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.models.gemma_arch import GEMMA_MODEL_TYPES, gemma_fields, text_config
from engine.models.moe_spec import MOE_MODEL_TYPES, MoeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *GEMMA_MODEL_TYPES,
                         *MOE_MODEL_TYPES)
_QK_NORM_TYPES = ("qwen3", "gemma3_text", "gemma3", "qwen3_moe")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that the KV cache and the FLOPs count need."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int | None = None
    intermediate: int | None = None
    vocab: int | None = None
    tied_embeddings: bool = False
    attention_bias: bool = False
    max_position: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k
    # Per-layer sliding window (None: full), () when unknown or all full: kv-calc's KV groups.
    sliding_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        for f in ("layers", "heads", "kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer; got {v!r} for model "
                                 f"{self.name!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}) for model {self.name!r}")

    def non_embedding_params(self) -> int:
        """Weights outside the token embedding and the LM head (norms included, Kaplan's N)."""
        if self.hidden is None or self.intermediate is None:
            raise ValueError(f"model {self.name!r} lacks hidden/intermediate sizes; give a "
                             f"config.json or .gguf to count its parameters")
        h, q = self.hidden, self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * (attn + mlp + norms) + h

    def replace(self, **changes: Any) -> ModelShape:
        return dataclasses.replace(self, **changes)


def shape_from_hf_config(config: Any, name: str) -> ModelShape:
    """Read a transformers config (a ``config.json`` dict or a ``PretrainedConfig``; Llama,
    Mistral, Qwen2/3 and alike; a multimodal config's ``text_config``)."""
    config = _get(config, "text_config") or config

    def required(key: str) -> int:
        value = _get(config, key)
        if value is None:
            raise ValueError(f"{name}: config lacks {key!r}; is it a decoder-only LM config?")
        return int(value)

    heads = required("num_attention_heads")
    hidden = required("hidden_size")
    layers = required("num_hidden_layers")
    model_type = _get(config, "model_type")
    intermediate, vocab = _get(config, "intermediate_size"), _get(config, "vocab_size")
    return ModelShape(
        name=name, layers=layers, heads=heads,
        kv_heads=int(_get(config, "num_key_value_heads") or heads),
        head_dim=int(_get(config, "head_dim") or hidden // heads),
        hidden=hidden, intermediate=None if intermediate is None else int(intermediate),
        vocab=None if vocab is None else int(vocab),
        tied_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        attention_bias=bool(_get(config, "attention_bias", model_type == "qwen2")),
        max_position=_get(config, "max_position_embeddings"),
        qk_norm=model_type in _QK_NORM_TYPES,
        sliding_windows=_sliding_windows(config, model_type or "llama", layers))


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
    # Gemma 2/3 (engine.models.gemma_arch): RoPE of the sliding-window layers (None: ``rope``),
    # query scale (None: head_dim ** -0.5), tanh soft-caps (None: off), embedding multiplier.
    rope_local: RopeSpec | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    moe: MoeSpec | None = None  # mixture-of-experts layers (engine.models.moe_spec)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        model_type = _get(config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r}; kvserve runs "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        gemma: dict[str, Any] = {}
        if model_type in GEMMA_MODEL_TYPES:
            config = text_config(config)
            gemma = gemma_fields(config, RopeSpec.from_config)
        else:
            act = _get(config, "hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"unsupported activation {act!r}; kvserve supports silu")
        shape = shape_from_hf_config(config, model_type)
        if shape.vocab is None or shape.intermediate is None:
            raise ValueError(f"{model_type}: config lacks vocab_size or intermediate_size")
        windows = _sliding_windows(config, model_type, shape.layers)
        attention_bias = bool(_get(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_layers=shape.layers,
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(_get(config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; the others follow attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(_get(config, "mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            sliding_windows=windows,
            **(gemma or dict(rope=RopeSpec.from_config(config), hidden_act="silu")),
            moe=MoeSpec.from_hf_config(config, model_type, shape.layers),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def shape(self) -> ModelShape:
        """The sizes alone (what kv-calc and the FLOPs yardstick count with)."""
        return ModelShape(
            self.model_type, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
            self.hidden_size, self.intermediate_size, self.vocab_size, self.tie_word_embeddings,
            self.qkv_bias, self.max_position_embeddings, self.qk_norm)


def _sliding_windows(config: Any, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = _get(config, "sliding_window")
    layer_types = _get(config, "layer_types")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if not _get(config, "use_sliding_window", False) or not window:
            return (None,) * layers
    if not window:
        return (None,) * layers
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * layers
