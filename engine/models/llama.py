"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

The batch is packed: every sequence's new tokens of a step side by side (``[T]``), with no
padding. Attention reads and writes the paged KV pool through an attention backend; everything
else is a handful of matmuls per layer with Q/K/V fused into one projection and gate/up into one.
Weights are loaded from HF parameter names (``model.layers.N.self_attn.q_proj.weight`` …).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionBackend, AttentionMetadata
from engine.models.arch import ModelArch
from engine.models.layer_ops import TorchLayerOps
from engine.models.rope import RotaryEmbedding
from engine.quantization.packed_linear import PackedLinear, pack_linears

if TYPE_CHECKING:
    from engine.lora.weights import LoRAWeights
    from engine.models.tp_group import TPGroup

_TORCH_OPS = TorchLayerOps()


class FastDecodeStack(Protocol):
    """What the model asks of a whole-layer-loop replacement for a decode step (the C++ one is
    ``engine.models.cpu_decode_stack.CpuDecodeStack``, attached by the runner; this module
    does not import it). ``accepts`` is asked after ``backend.prepare``; when it says yes,
    the call returns the final hidden states ``[T, hidden]`` that the layer loop would."""

    def accepts(self, x: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                ops: TorchLayerOps) -> bool: ...

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Holds the scale and epsilon; the arithmetic is the layer ops' ``rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    """``arch`` holds this rank's head and feature counts under tensor parallelism (``tp``):
    the O and down outputs are then partial sums, added across ranks here."""

    def __init__(self, arch: ModelArch, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.layer_idx = layer_idx
        self.sliding_window = arch.sliding_windows[layer_idx]
        self.scale = d ** -0.5
        # fp8 KV pools: this layer's per-KV-head K and V scales (set by the runner; None = 1.0),
        # and an optional observer of the layer's new K/V (the runner's scale calibration).
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_observer = None
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=arch.o_bias)
        self.gate_up_proj = nn.Linear(h, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, h, bias=arch.mlp_bias)
        self.intermediate_size = arch.intermediate_size
        if arch.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(d, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                ops: TorchLayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` in, ``(mlp_out, residual)`` out: the residual add of each block is
        done by the next norm (fused there), the last one by the model's final norm."""
        t = x.shape[0]
        if residual is None:
            residual = x
            x = self.input_layernorm(x, ops)
        else:
            x, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight,
                                           self.input_layernorm.eps)
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q = ops.rotary(self.q_norm(q.reshape(t, self.num_heads, self.head_dim), ops),
                           cos, sin)
            k = ops.rotary(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim), ops),
                           cos, sin)
        else:
            # Q and K heads side by side in the fused projection: rotate them in one pass.
            qk = ops.rotary(qkv[:, :self.q_size + self.kv_size]
                            .view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.kv_observer is not None:
            self.kv_observer(self.layer_idx, k, v, q)
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                               self.sliding_window, self.kv_scales)
        o = self.o_proj(attn.reshape(t, self.q_size))
        if self.tp is not None:
            self.tp.all_reduce_(o)
        x, residual = ops.add_rms_norm(o, residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
        down = self.feed_forward(x, ops)
        if self.tp is not None:
            self.tp.all_reduce_(down)
        return down, residual

    def feed_forward(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        """The MLP of the normed ``[T, hidden]`` input (a mixture-of-experts layer overrides
        it, engine.models.moe_model)."""
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    """Decoder over packed tokens. ``forward`` returns final hidden states ``[T, hidden]``;
    ``compute_logits`` projects only the rows that are sampled.

    Tensor parallelism (``tp``, see ``engine.models.tp_sharding``): ``arch`` holds this rank's
    head and feature counts; the token table and the logits head hold this rank's vocabulary
    rows; lookups are summed and logits gathered across ranks, so ``forward`` and
    ``compute_logits`` return what the whole model would, on every rank."""

    def __init__(self, arch: ModelArch, max_positions: int | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        rows = arch.vocab_size if tp is None else tp.shard.vocab[1] - tp.shard.vocab[0]
        self.embed_tokens = nn.Embedding(rows, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, rows, bias=False)
        self.tied_head: PackedLinear | None = None  # set by pack_linears when embeddings are tied
        self.ops: TorchLayerOps = _TORCH_OPS  # the runner may swap in the fused CPU ops
        # The C++ decode-step layer loop (engine.models.cpu_decode_stack), set by the runner.
        self.decode_stack: FastDecodeStack | None = None
        # LoRA adapters' slots and the step's rows by adapter (engine.lora.layer.attach_lora).
        self.lora: LoRAWeights | None = None
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim,
                                      max_positions or arch.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, ops: TorchLayerOps | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``; ``ops`` overrides the model's layer ops."""
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype, meta.max_seq_len - 1)
        backend.prepare(meta)
        ops = ops or self.ops
        stack = self.decode_stack
        if stack is not None and stack.accepts(x, meta, backend, kv_caches, ops):
            return stack(x, cos, sin, kv_caches, meta)
        residual = None
        # A hybrid KV cache gives each layer its group's tables and slots (for_layer).
        metas = meta.layer_metas or [meta] * len(self.layers)
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas):
            x, residual = layer(x, residual, cos, sin, kv_cache, m, backend, ops)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup (zero for ids outside its range), summed over ranks:
        exact, as every row has one non-zero term."""
        start, stop = self.tp.shard.vocab
        outside = (input_ids < start) | (input_ids >= stop)
        x = self.embed_tokens((input_ids - start).clamp_(0, stop - start - 1))
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.tied_head is not None:
            logits = self.tied_head(hidden).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    @property
    def head_columns(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
        """The logits head's ``forward_columns`` (a packed head, ``QuantLinear``) when the
        vocabulary is not sharded; None for a float head or under tensor parallelism."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        return None if self.tp is not None else getattr(head, "forward_columns", None)

    def compute_logits_columns(self, hidden: torch.Tensor,
                               columns: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden)[:, columns]``, bit for bit, computing only those columns;
        None where the head cannot promise that (no ``head_columns``, or a packed head off its
        per-row kernels: ``QuantLinear.forward_columns``). See engine/runner/logit_columns.py."""
        columns_of = self.head_columns
        out = None if columns_of is None else columns_of(hidden, columns)
        return None if out is None else out.float()

    def pack_linears(self, backend: str) -> int:
        """Move every projection (and a tied logits head) onto packed weights for ``backend``;
        see ``engine.quantization.packed_linear``. Returns the number of layers packed."""
        n = pack_linears(self, backend)
        if self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding):
            self.tied_head = PackedLinear(self.embed_tokens.weight, None, backend)
            n += 1
        return n

    # ---- weights -------------------------------------------------------------------------

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """``--load-format dummy``: random weights of the model's shape, made where the
        parameters already live (no checkpoint is read). Matrices ~ N(0, std), norm scales 1,
        biases 0: enough for timing and memory sizing, not for meaningful text."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=gen)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Iterable[str] = ()) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises ValueError naming any
        parameter that is missing or has the wrong shape. ``skip``: HF names that count as
        loaded without being given (tensors another module will serve, e.g. packed weights);
        their parameters are left as they are."""
        params = dict(self.named_parameters())
        loaded: set[str] = {self._loaded_key(name) for name in skip}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embeddings
            target, shard = self._target(name)
            if shard is not None:
                self._load_shard(params, target, shard, tensor)
            elif target not in params:
                raise ValueError(f"checkpoint has an unexpected parameter {name!r}")
            else:
                self._copy(params[target], tensor, name)
            loaded.add(self._loaded_key(name))
        missing = [n for n in params if n not in loaded and not self._fully_sharded(n, loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {', '.join(missing[:5])}"
                             + (" …" if len(missing) > 5 else ""))

    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @classmethod
    def _target(cls, name: str) -> tuple[str, int | None]:
        """Our parameter for an HF name, and the part of a fused projection it fills (or None)."""
        target = name.removeprefix("model.")
        target = target.replace(".self_attn.", ".").replace(".mlp.", ".")
        parts = target.split(".")
        if len(parts) >= 3 and parts[-2] in cls._FUSED:
            fused_name, shard = cls._FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused_name, parts[-1]]), shard
        return target, None

    @classmethod
    def _loaded_key(cls, name: str) -> str:
        target, shard = cls._target(name)
        return target if shard is None else f"{target}#{shard}"

    def _shard_sizes(self, fused_name: str) -> list[int]:
        layer = self.layers[0]
        if fused_name == "qkv_proj":
            return [layer.q_size, layer.kv_size, layer.kv_size]
        return [layer.intermediate_size, layer.intermediate_size]

    def _load_shard(self, params: dict[str, nn.Parameter], target: str, shard: int,
                    tensor: torch.Tensor) -> None:
        if target not in params:
            raise ValueError(f"checkpoint has an unexpected parameter for {target!r}")
        sizes = self._shard_sizes(target.split(".")[-2])
        start = sum(sizes[:shard])
        self._copy(params[target].data.narrow(0, start, sizes[shard]), tensor, target)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(src.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))

    def _fully_sharded(self, name: str, loaded: set[str]) -> bool:
        fused_name = name.split(".")[-2]
        if fused_name not in ("qkv_proj", "gate_up_proj"):
            return False
        return all(f"{name}#{i}" in loaded for i in range(len(self._shard_sizes(fused_name))))
