"""A decode step's layer loop in one C++ call (CPU, float32): ``CpuDecodeStack``.

``DecodeStack`` (engine/cpu/csrc/decode_stack_cpu.cpp) runs the kernels of the Python layer loop
in the same order on the same tensors from C++ (saving the Python around them:
docs/decisions.md#decode-stack), so its output is bit-identical to ``LlamaForCausalLM.forward``'s
loop with the fused CPU ops and the torch backend's CPU decode kernel.
``build_decode_stack(model)`` returns one when the model can use it (no tensor parallelism, the
fused CPU ops, float32, projections ``QuantLinear`` (int8 or faithful activations) /
``QuantConcat`` / panel ``PackedLinear`` / ``nn.Linear``; Llama-style, Gemma 2 / 3 or
mixture-of-experts layers), else None and the reason.
``accepts`` then decides per step: every row a decode row in every KV group, at most ``max_rows``
rows (beyond, the linears switch kernels), float32, float16, bfloat16, int8 or int4 KV pools (not
fp8), no KV observer or fp8 scales; a hybrid KV cache gives each group's slots and tables.
Anything else runs the Python loop. ``KVSERVE_DECODE_STACK=0`` turns it off (A/B runs). The
stack holds the modules' weight tensors: build it after the weights are final (quantisation
adopted, linears packed), and again if a projection is replaced. LoRA adapters
(``engine.lora``): a wrapped projection's base runs here, and each step with adapter rows
adds their delta after it with the kernel the Python path uses (``lora_apply_``): the
``cpu-kernel`` LoRA kind only (another keeps such steps in Python)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import envs
from engine.attention.torch_backend import CPU_KERNEL_FLOAT_POOLS
from engine.kv_format.formats import INT8_SCALE_FLOOR
from engine.lora.layer import LoRALinear
from engine.models.layer_ops import FusedCpuOps, TorchLayerOps
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import PackedExperts
from engine.quantization.linear import QuantConcat, QuantLinear
from engine.quantization.packed_linear import PackedLinear

NO_LIMIT = 1 << 62
# The KV pools the C++ stack stores into and decodes over (DecodeStack::set_kv_caches): the
# CPU decode kernel's float pools, int8 and int4 (uint8 rows; not fp8).
STACK_POOL_DTYPES = (*CPU_KERNEL_FLOAT_POOLS, torch.int8, torch.uint8)
# StackLinear kinds (decode_stack_cpu.h)
_FLOAT, _Q4, _Q4_VNNI, _Q8, _PANELS, _Q8_VNNI, _Q4_BLOCKED, _Q5 = 0, 1, 2, 3, 4, 5, 6, 8
_Q8_INTERLEAVED, _FAITHFUL_Q4, _FAITHFUL_Q8 = 9, 10, 11


@dataclass(frozen=True)
class _Linear:
    spec: object  # the C++ StackLinear
    max_rows: int  # rows up to which the module itself would use this kernel


def stack_linear(kernels, mod: nn.Module) -> _Linear | str:
    """The C++ description of one projection (its ``spec``, a ``StackLinear``), or why it has
    none."""
    if isinstance(mod, QuantConcat):
        parts = [stack_linear(kernels, p) for p in mod.parts]
        if any(isinstance(p, str) for p in parts):
            return next(p for p in parts if isinstance(p, str))
        rows = min(p.max_rows for p in parts)
        if mod.fallback is not None:
            rows = min(rows, mod.float_above)
        return _Linear(kernels.StackLinear([p.spec for p in parts]), rows)
    if isinstance(mod, QuantLinear):
        rows = mod.dense_rows if mod.fallback is None else min(mod.dense_rows, mod.float_above)
        if mod.faithful:  # the rows layouts (set_kernels), engine/cpu/kernels_faithful.py
            from engine.cpu import kernels_faithful

            bits = 4 if mod.is_q4 else 8
            return _Linear(kernels.StackLinear(
                _FAITHFUL_Q4 if bits == 4 else _FAITHFUL_Q8, mod.qs, mod.d, mod.m, mod.bias,
                mod.out_features, fn=kernels_faithful.kernel_address(bits),
                bf16=mod.kernels.activation == "bf16"), rows)
        if mod.is_q5:
            kind = _Q5
        elif mod.blocked:
            kind = _Q4_BLOCKED
        elif mod.is_q4:
            kind = _Q4_VNNI if mod.kernels.q4_kernel == "vnni" else _Q4
        elif mod.interleaved:
            kind = _Q8_INTERLEAVED
        else:
            kind = _Q8_VNNI if mod.kernels.q8_kernel == "vnni" else _Q8
        return _Linear(kernels.StackLinear(kind, mod.qs, mod.d, mod.m, mod.bias,
                                           mod.out_features,
                                           mod.tiles_from or mod.lanes_from or mod.amx_from or 0,
                                           mod.kernels.q4_tiles == "vnni"), rows)
    if isinstance(mod, PackedLinear):
        if mod.panels is None or mod.small_rows <= 0:
            return f"{mod.backend} packed linear (oneDNN only)"
        return _Linear(kernels.StackLinear(_PANELS, mod.panels, None, None, mod.panel_bias,
                                           mod.out_features), mod.small_rows)
    if type(mod) is nn.Linear:
        if mod.weight.dtype != torch.float32:
            return f"{mod.weight.dtype} linear"
        return _Linear(kernels.StackLinear(_FLOAT, mod.weight.detach(), None, None,
                                           None if mod.bias is None else mod.bias.detach(),
                                           mod.out_features), NO_LIMIT)
    return f"{type(mod).__name__} projection"


class CpuDecodeStack:
    """The C++ layer stack of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, kernels, ops: FusedCpuOps) -> None:
        self._stack = kernels.DecodeStack()
        self._lora = getattr(model, "lora", None)  # the adapters' slots, when LoRA is on
        loras: list[tuple[int, int, tuple]] = []
        self._ops = ops
        self.max_rows = NO_LIMIT
        self._layers = list(model.layers)
        self._final = model.norm
        self._moe = []  # the MoE blocks (their ``record`` switch keeps a step in Python)
        for i, layer in enumerate(self._layers):
            specs = {}
            moe = getattr(layer, "moe", None)
            names = ("qkv_proj", "o_proj") if moe is not None else (
                "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            for m, name in enumerate(names):
                mod = getattr(layer, name)
                if isinstance(mod, LoRALinear):
                    lora = mod.weights.stack_specs(layer.layer_idx, name)
                    if lora is not None:
                        loras.append((i, m, lora))
                    mod = mod.base
                specs[name] = self._spec(kernels, mod, f"layer {layer.layer_idx} {name}")
            if moe is not None:
                specs["moe"] = self._moe_spec(kernels, moe, layer.layer_idx)
                self._moe.append(moe)
            self._stack.add_layer(_layer(kernels, layer, specs))
        for i, m, (a, bs, ranks, offsets) in loras:
            self._stack.set_lora(i, m, a, bs, ranks, offsets)
        # LoRA steps run here only when every wrapped projection's delta does.
        self._lora_here = self._lora is not None and self._lora.kind == "cpu-kernel"
        self._stack.set_prefetch(envs.stack_prefetch_bytes())
        self._groups: list[int] | None = None  # the layers' KV groups as last set
        self._bound_caches: list | None = None
        self._bound_k0: torch.Tensor | None = None
        self.calls = 0  # steps run here

    def _spec(self, kernels, mod: nn.Module, where: str) -> object:
        """The StackLinear of ``mod`` (ValueError naming ``where`` if it has none); the
        stack's row limit shrinks to the linear's."""
        lin = stack_linear(kernels, mod)
        if isinstance(lin, str):
            raise ValueError(f"{where}: {lin}")
        self.max_rows = min(self.max_rows, lin.max_rows)
        return lin.spec

    def _moe_spec(self, kernels, moe: nn.Module, idx: int) -> object:
        """The StackMoe of a MoeBlock: packed experts' linears, or float experts' slices
        (the grouped path only: the dense one is not the same arithmetic)."""
        experts = moe.experts
        if isinstance(experts, PackedExperts):
            gate_up = [self._spec(kernels, m, f"layer {idx} expert {e} gate/up")
                       for e, m in enumerate(experts.gate_up)]
            down = [self._spec(kernels, m, f"layer {idx} expert {e} down")
                    for e, m in enumerate(experts.down)]
        elif getattr(experts, "path", None) in ("auto", "grouped") and \
                experts.gate_up_proj.dtype == torch.float32:
            gate_up = [kernels.StackLinear(_FLOAT, w, None, None, None, w.shape[0])
                       for w in experts.gate_up_proj.detach()]
            down = [kernels.StackLinear(_FLOAT, w, None, None, None, w.shape[0])
                    for w in experts.down_proj.detach()]
        else:
            raise ValueError(f"layer {idx}: experts on the {getattr(experts, 'path', '?')} "
                             "path")
        if moe.gate.weight.dtype != torch.float32:
            raise ValueError(f"layer {idx}: {moe.gate.weight.dtype} router")
        return kernels.StackMoe(moe.gate.weight.detach(), moe.top_k, bool(moe.normalise),
                                gate_up, down, envs.moe_concurrent())

    def accepts(self, x: torch.Tensor, meta, backend, kv_caches, ops: TorchLayerOps) -> bool:
        """Whether this step can run here (module docstring); call after ``backend.prepare``
        (of every KV group's metadata)."""
        if ops is not self._ops or getattr(backend, "name", None) != "torch":
            return False
        t = x.shape[0]
        if t > self.max_rows:
            return False
        for m in _group_metas(meta)[0]:
            state = m.backend_state
            group = state.get("decode")
            if state.get("prefills") or group is None or group.num_rows != t:
                return False
        if (not kv_caches or kv_caches[0][0].dtype not in STACK_POOL_DTYPES
                or x.dtype != torch.float32):
            return False
        if self._lora is not None and self._lora.batch is not None and not self._lora_here:
            return False
        return all(layer.kv_observer is None and layer.kv_scales is None
                   for layer in self._layers) and not any(m.record for m in self._moe)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta,
                 local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (what the model's forward returns).
        ``local_rope``: the (cos, sin) of Gemma 3's local layers."""
        if kv_caches is not self._bound_caches or kv_caches[0][0] is not self._bound_k0:
            self._stack.set_kv_caches([k for k, _ in kv_caches], [v for _, v in kv_caches],
                                      INT8_SCALE_FLOOR)
            self._bound_caches, self._bound_k0 = kv_caches, kv_caches[0][0]
        metas, groups = _group_metas(meta)
        if groups != self._groups:
            self._stack.set_layer_groups(groups or [0] * len(self._layers))
            self._groups = groups
        decode = [m.backend_state["decode"] for m in metas]
        coss, sins = [cos], [sin]
        if local_rope is not None:
            coss.append(local_rope[0])
            sins.append(local_rope[1])
        self.calls += 1
        batch = self._lora.batch if self._lora is not None else None
        return self._stack.forward(x, coss, sins, [m.slot_mapping for m in metas],
                                   [g.tables_i32 for g in decode], [g.lens_i32 for g in decode],
                                   self._final.weight.detach(), self._final.eps,
                                   None if batch is None else batch.row_slots)


def _group_metas(meta) -> tuple[list, list[int] | None]:
    """The step's KV groups' metadata (group 0's first) and each layer's group index (None:
    one group)."""
    if meta.layer_metas is None:
        return [meta], None
    index: dict[int, int] = {}
    metas = []
    groups = []
    for m in meta.layer_metas:
        g = index.get(id(m))
        if g is None:
            g = index[id(m)] = len(metas)
            metas.append(m)
        groups.append(g)
    return metas, groups


def _layer(kernels, layer: nn.Module, specs: dict) -> object:
    """The C++ ``StackLayer`` of a Llama-style or Gemma decoder layer (module docstring)."""
    sandwich = getattr(layer, "pre_feedforward_layernorm", None) is not None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.q_norm is not None:
        norms += [layer.q_norm, layer.k_norm]
    if sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if len({n.eps for n in norms}) != 1:
        raise ValueError(f"layer {layer.layer_idx}: norms with different epsilons")

    def weight(norm) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    return kernels.StackLayer(
        weight(layer.input_layernorm), weight(layer.post_attention_layernorm),
        layer.input_layernorm.eps, specs["qkv_proj"], specs["o_proj"], specs.get("gate_up_proj"),
        specs.get("down_proj"), layer.num_heads, layer.num_kv_heads, layer.head_dim,
        layer.sliding_window or 0, layer.scale, weight(layer.q_norm), weight(layer.k_norm),
        pre_ff_norm=weight(getattr(layer, "pre_feedforward_layernorm", None)),
        post_ff_norm=weight(getattr(layer, "post_feedforward_layernorm", None)),
        act=1 if sandwich else 0, rope=1 if getattr(layer, "local_rope", False) else 0,
        moe=specs.get("moe"), softcap=getattr(layer, "softcap", None) or 0.0)


def build_decode_stack(model: nn.Module) -> tuple[CpuDecodeStack | None, str]:
    """A stack for ``model`` and "", or None and why not."""
    if not envs.decode_stack_enabled():
        return None, "KVSERVE_DECODE_STACK=0"
    if not isinstance(model, LlamaForCausalLM):
        return None, f"{type(model).__name__} model"
    if getattr(model, "tp", None) is not None:
        return None, "tensor parallel"
    ops = getattr(model, "ops", None)
    if not isinstance(ops, FusedCpuOps):
        return None, "not the fused CPU layer ops"
    from engine.cpu.kernels import load

    kernels = load()
    if kernels is None or not hasattr(kernels, "DecodeStack"):
        return None, "CPU kernels unavailable"
    try:
        return CpuDecodeStack(model, kernels, ops), ""
    except ValueError as exc:
        return None, str(exc)
