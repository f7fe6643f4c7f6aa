"""Gemma 2 and Gemma 3 text decoders, on the Llama model's weights plumbing.

What differs from :mod:`engine.models.llama` (HF ``modeling_gemma2`` / ``modeling_gemma3``):
RMSNorm scales by ``(1 + w)``, stored as ``1 + w`` at load so every layer-ops implementation runs
a plain RMSNorm (HF's arithmetic exactly in float32; the last bit may differ in 16-bit dtypes);
sandwich norms (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``); embeddings times ``sqrt(hidden)`` rounded to the dtype; a GeGLU
MLP (``gelu_tanh_mul``); queries scaled by ``query_pre_attn_scalar ** -0.5``. Gemma 3: RMSNorm
over each head's q and k before RoPE, sliding-window layers with their own RoPE base
(``arch.rope_local``). Gemma 2: attention logits soft-capped (``cap * tanh(s / cap)`` before the
mask, the backends' ``softcap``) and final logits too. Both run in the C++ decode stack
(engine/models/cpu_decode_stack.py), bit-identical to :meth:`GemmaDecoderLayer.forward`.
Weights load from HF names, also a ``Gemma3ForConditionalGeneration`` checkpoint's text part
(``model.language_model.*`` / ``language_model.model.*``); its vision tower is loaded apart
(engine/vision). ``forward(..., image_embeds=(rows, embeddings))`` puts the image encoder's
embeddings in place of those rows' scaled token embeddings (HF's ``masked_scatter``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.models.arch import ModelArch
from engine.models.layer_ops import TorchLayerOps
from engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from engine.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from engine.models.tp_group import TPGroup

# Prefixes of a multimodal Gemma 3 checkpoint's text model -> the text-only names.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "q_norm", "k_norm", "norm")


class GemmaDecoderLayer(DecoderLayer):
    """A Gemma 2/3 block; ``(x, residual)`` in and out as in the Llama layer, where ``x`` is the
    block's normalised MLP output (its residual add is done by the next norm)."""

    def __init__(self, arch: ModelArch, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__(arch, layer_idx, tp)
        h = arch.hidden_size
        self.pre_feedforward_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(h, arch.rms_norm_eps)
        if arch.query_scale is not None:
            self.scale = arch.query_scale
        self.softcap = arch.attn_softcap
        self.local_rope = self.sliding_window is not None and arch.rope_local is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                ops: TorchLayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        if residual is None:
            residual = x
            x = self.input_layernorm(x, ops)
        else:
            x, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight,
                                           self.input_layernorm.eps)
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].reshape(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(t, self.num_kv_heads,
                                                                   self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rotary(q.contiguous(), cos, sin), ops.rotary(k.contiguous(), cos, sin)
        if self.kv_observer is not None:
            self.kv_observer(self.layer_idx, k, v, q)
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                               self.sliding_window, self.kv_scales, **extra)
        o = self.o_proj(attn.reshape(t, self.q_size))
        if self.tp is not None:
            self.tp.all_reduce_(o)
        o = self.post_attention_layernorm(o, ops)
        x, residual = ops.add_rms_norm(o, residual, self.pre_feedforward_layernorm.weight,
                                       self.pre_feedforward_layernorm.eps)
        down = self.down_proj(ops.gelu_tanh_mul(self.gate_up_proj(x)))
        if self.tp is not None:
            self.tp.all_reduce_(down)
        return self.post_feedforward_layernorm(down, ops), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text model (module docstring); the Llama model's interface."""

    def __init__(self, arch: ModelArch, max_positions: int | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__(arch, max_positions=max_positions, tp=tp)
        self.layers = torch.nn.ModuleList(GemmaDecoderLayer(arch, i, tp)
                                          for i in range(arch.num_layers))
        # The local layers' RoPE table, built on first use where the global one lives (kept
        # out of the module tree: the runner rebuilds ``self.rotary`` after allocation).
        self._local_rotary: list[RotaryEmbedding] = []

    def _local_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                       max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.rotary.cos_half
        if not self._local_rotary or self._local_rotary[0].cos_half.device != table.device or \
                self._local_rotary[0].cos_half.shape != table.shape:
            with torch.device(table.device):
                self._local_rotary[:] = [RotaryEmbedding(self.arch.rope_local, self.arch.head_dim,
                                                         table.shape[0])]
        return self._local_rotary[0].cos_sin(positions, dtype, max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, ops: TorchLayerOps | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        if image_embeds is not None:
            rows, values = image_embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        rope = self.rotary.cos_sin(positions, x.dtype, meta.max_seq_len - 1)
        local = rope
        if self.arch.rope_local is not None:
            local = self._local_cos_sin(positions, x.dtype, meta.max_seq_len - 1)
        backend.prepare(meta)
        ops = ops or self.ops
        stack = self.decode_stack
        if stack is not None and stack.accepts(x, meta, backend, kv_caches, ops):
            return stack(x, *rope, kv_caches, meta, local_rope=local)
        residual = None
        # A hybrid KV cache gives each layer its group's tables and slots (for_layer).
        metas = meta.layer_metas or [meta] * len(self.layers)
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas):
            cos, sin = local if layer.local_rope else rope
            x, residual = layer(x, residual, cos, sin, kv_cache, m, backend, ops)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._cap(super().compute_logits(hidden))

    def compute_logits_columns(self, hidden: torch.Tensor,
                               columns: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits_columns(hidden, columns)
        return None if logits is None else self._cap(logits)

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping (elementwise, so a column subset caps the same)."""
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Iterable[str] = ()) -> None:
        """The Llama loader over text-model names, with every RMSNorm scale stored as
        ``1 + w`` (module docstring)."""
        super().load_weights(_text_weights(weights), skip=[_text_name(n) or n for n in skip])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:  # type: ignore[override]
        if name.split(".")[-2] in _NORMS and name.endswith(".weight"):
            src = src.float() + 1.0
        LlamaForCausalLM._copy(dst, src, name)


def _text_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor, None for a vision-tower one."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        text = _text_name(name)
        if text is not None:
            yield text, tensor
