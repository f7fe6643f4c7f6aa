"""The mixture-of-experts part of a model's shape, read from its HF config (no torch).

Two checkpoint families, one routing rule (engine.models.moe): the router's logits go through
a softmax over all experts, the ``top_k`` largest probabilities are kept and, when
``norm_topk_prob``, divided by their sum (which equals a softmax over the top-k logits alone).

* Qwen3-MoE (``qwen3_moe``): ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``norm_topk_prob`` from the config (Qwen3-30B-A3B: true); a layer is sparse unless listed in
  ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid, and dense layers keep the plain
  MLP of ``intermediate_size``.
* Mixtral (``mixtral``): ``num_local_experts``, ``num_experts_per_tok``, experts of
  ``intermediate_size``; every layer sparse; the top-k weights are always renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class MoeSpec:
    """Experts per layer, experts per token, one expert's intermediate size, whether the top-k
    weights are renormalised, and which layers are sparse (``sparse_layers[i]``)."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]

    def __post_init__(self) -> None:
        for f in ("num_experts", "top_k", "expert_intermediate"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"mixture of experts: {f} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"mixture of experts: {self.top_k} experts per token but only "
                             f"{self.num_experts} experts; fix num_experts_per_tok")

    @classmethod
    def from_hf_config(cls, config: Any, model_type: str, layers: int) -> MoeSpec | None:
        """The spec of a ``qwen3_moe`` or ``mixtral`` config; None for other model types."""
        config = _get(config, "text_config") or config
        if model_type == "mixtral":
            return cls(num_experts=int(_get(config, "num_local_experts", 8)),
                       top_k=int(_get(config, "num_experts_per_tok", 2)),
                       expert_intermediate=int(_get(config, "intermediate_size")),
                       norm_topk_prob=True, sparse_layers=(True,) * layers)
        if model_type != "qwen3_moe":
            return None
        experts = int(_get(config, "num_experts", 0) or 0)
        step = int(_get(config, "decoder_sparse_step", 1) or 1)
        dense_only = set(_get(config, "mlp_only_layers", None) or ())
        sparse = tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0
                       for i in range(layers))
        if not any(sparse):
            raise ValueError("qwen3_moe config has no sparse layer (num_experts, "
                             "mlp_only_layers, decoder_sparse_step); use a qwen3 config")
        inter = _get(config, "moe_intermediate_size")
        if inter is None:
            raise ValueError("qwen3_moe config lacks moe_intermediate_size")
        return cls(num_experts=experts, top_k=int(_get(config, "num_experts_per_tok", 8)),
                   expert_intermediate=int(inter),
                   norm_topk_prob=bool(_get(config, "norm_topk_prob", False)),
                   sparse_layers=sparse)
