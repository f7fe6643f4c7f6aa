"""Maps an HF config's architecture to kvserve's model class."""

from __future__ import annotations

from typing import Any

from engine.models.arch import ModelArch
from engine.models.gemma import GemmaForCausalLM
from engine.models.gemma_arch import GEMMA_MODEL_TYPES
from engine.models.llama import LlamaForCausalLM
from engine.models.moe_model import MoeForCausalLM

_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,  # the text model only
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def build_model(hf_config: Any, max_positions: int | None = None,
                tp: Any = None) -> LlamaForCausalLM:
    """Instantiate (uninitialised weights) the model class for ``hf_config``; with ``tp`` (an
    ``engine.models.tp_group.TPGroup``) only this rank's shard of it."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    known = [a for a in archs if a in _ARCHITECTURES]
    if archs and not known:
        raise ValueError(f"unsupported architecture {archs[0]!r}; kvserve runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = ModelArch.from_hf_config(hf_config)
    if known:
        cls = _ARCHITECTURES[known[0]]
    elif arch.moe is not None:  # a config without ``architectures``: its model type decides
        cls = MoeForCausalLM
    else:
        cls = GemmaForCausalLM if arch.model_type in GEMMA_MODEL_TYPES else LlamaForCausalLM
    if tp is None:
        return cls(arch, max_positions=max_positions)
    from engine.models.tp_sharding import local_arch

    return cls(local_arch(arch, tp.shard), max_positions=max_positions, tp=tp)
