"""Put packed quantised weights into a loaded Llama-family model.

``quantization="auto"`` keeps a GGUF checkpoint's own quantised tensors packed where a start-up
probe measures that faster (float checkpoints stay float); ``"int4"`` / ``"int8"`` quantise
the float weights on load (``engine.quantization.rtn``) and always use them, as requested;
``"none"`` never gets here. The steps, called by the model runner:

1. :func:`packed_replacements` builds the modules (:func:`build_quantised` for a GGUF, each
   packed weight checked against the float weight already loaded: a mismatch raises
   ``ValueError``; :func:`build_rtn` for int4/int8);
2. :func:`adopt`: for int4/int8, :func:`apply` at once; for auto, :func:`adopt_if_faster`
   after float packing: the probe (``engine.quantization.probe.choose``, its verdict cached per
   machine) picks ``quant``, ``hybrid`` (float kept for larger inputs) or ``float``, within
   :data:`AUTO_MEMORY_FACTOR` of the packed bytes (:func:`float_memory_reason`);
3. :func:`apply` swaps the modules in (with their float fallbacks in ``hybrid``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine import envs
from engine.loading.gguf_quant import gguf_source, read_packed
from engine.loading.packed_policy import float_copies_too_big
from engine.quantization import probe_cache
from engine.quantization.formats import Packed, cat, same_layout
from engine.quantization.linear import (
    QuantConcat,
    QuantEmbedding,
    QuantisedModules,
    QuantLinear,
    quant_kernels,
)
from engine.quantization.probe import (
    MAX_PROBE_ATTEMPTS,
    Verdict,
    apply_settings,
    choose,
    float_modules,
    measure_settings,
)
from engine.quantization.rtn import SCHEMES, quantise
from engine.weight_prep.moe import packed_experts, rtn_experts

logger = logging.getLogger("kvserve.engine")

# The token table / logits head's scheme per requested scheme (see build_rtn). int4 keeps
# them at 8 bits: a 4-bit head costs far more perplexity than an 8-bit one
# (docs/decisions.md#quality-figures-behind-defaults).
HEAD_SCHEMES = {"int4": "int8", "int8": "int8"}
_FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "o_proj": ("self_attn.o_proj",), "down_proj": ("mlp.down_proj",)}


@torch.no_grad()
def build_quantised(model: nn.Module, packed: dict[str, Packed],
                    check: bool = True) -> QuantisedModules:
    """Quantised replacements for ``model``'s float ``nn.Linear``/``nn.Embedding`` modules
    (still in place; their biases loaded, and with ``check`` their weights too, each packed
    weight compared with its float copy: a mismatch, a name or row-order error, raises
    ``ValueError`` instead of serving wrong weights). Does not change ``model``. One
    ``QuantLinear`` per projection whose checkpoint tensors are all packed (Q/K/V and gate/up
    stay fused: their packed rows are concatenated, or, where the parts' formats differ as in
    Q4_K_M files, a ``QuantConcat`` runs one packed linear per format and joins the outputs),
    and a ``QuantEmbedding`` for the token table (the tied logits head reads the same data)."""
    out = QuantisedModules()
    for i, layer in enumerate(model.layers):
        for attr, sources in _FUSED.items():
            parts = [packed.get(f"model.layers.{i}.{s}.weight") for s in sources]
            if any(p is None for p in parts):
                continue  # not all packed: this projection stays float
            dense = getattr(layer, attr)
            q = _fused(parts, dense.bias)
            if check:
                _check(q, dense.weight, f"layers.{i}.{attr}")
            out.linears[f"layers.{i}.{attr}"] = q
    table = packed.get("model.embed_tokens.weight")
    if table is not None:
        out.embedding = QuantEmbedding(table)
        if check:
            _check(out.embedding.head, model.embed_tokens.weight, "embed_tokens")
    head = packed.get("lm_head.weight")
    if head is not None and model.lm_head is not None:
        out.linears["lm_head"] = QuantLinear(head)
        if check:
            _check(out.linears["lm_head"], model.lm_head.weight, "lm_head")
    out.experts = packed_experts(model, packed, check)
    return out


def _fused(parts: list[Packed], bias: torch.Tensor | None) -> QuantLinear | QuantConcat:
    """One module over the rows of ``parts``: a ``QuantLinear`` when they share a layout, else
    a ``QuantConcat`` of one ``QuantLinear`` per run of parts that do (bias split to match)."""
    runs: list[list[Packed]] = []
    for p in parts:
        if runs and same_layout([runs[-1][0], p]):
            runs[-1].append(p)
        else:
            runs.append([p])
    modules, start = [], 0
    for run in runs:
        weight = cat(run)
        rows = weight.shape[0]
        modules.append(QuantLinear(weight, None if bias is None else bias[start:start + rows]))
        start += rows
    return modules[0] if len(modules) == 1 else QuantConcat(modules)


def _check(q: QuantLinear | QuantConcat, weight: torch.Tensor, name: str) -> None:
    """The packed weight must dequantise to the float one loaded from the converted checkpoint
    (same source blocks, dequantised by transformers' reader): only float rounding may differ."""
    ref = weight.detach().float()
    rows = torch.arange(q.out_features)
    for start in range(0, q.out_features, 4096):  # bounded temporaries for big tables
        got = q.dequantize_rows(rows[start:start + 4096])
        want = ref[start:start + 4096]
        tol = 1e-5 * float(want.abs().max()) + 1e-7
        if got.shape != want.shape or float((got - want).abs().max()) > tol:
            raise ValueError(f"packed weight {name} does not match its dequantised copy "
                             "(row order or tensor mapping is wrong); use quantization='none'")


def apply(model: nn.Module, q: QuantisedModules, float_above: int | None = None) -> int:
    """Swap the quantised modules into ``model``; returns how many modules were replaced. With
    ``float_above``, each keeps the float module it replaces for inputs of more rows."""
    if float_above is not None:
        for dense, quant in float_modules(model, q):
            quant.keep_float_above(float_above, dense)
    for path, mod in [*q.linears.items(), *q.experts.items()]:
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    n = len(q.linears) + len(q.experts)
    if q.embedding is not None:
        model.embed_tokens = q.embedding
        if model.lm_head is None:
            model.tied_head = q.embedding.head
        n += 1
    return n


def packed_replacements(model: nn.Module, config, device: torch.device, dtype: torch.dtype,
                        files_dir: Path | None,
                        packed: dict[str, Packed] | None = None) -> QuantisedModules | None:
    """Step 1 for an engine: packed replacements for ``model``'s float modules, or None when
    the path does not apply. ``auto``: the modules over ``packed``, the GGUF's tensors that
    :func:`read_served_packed` read (None or empty: none). ``int4``/``int8``: the float weights
    quantised; ValueError when the packed kernels cannot run here (not the CPU, not float32,
    kernels unavailable)."""
    scheme = config.quantization
    if scheme in SCHEMES:
        if device.type != "cpu" or dtype != torch.float32 or quant_kernels() is None:
            raise ValueError(f"quantization={scheme} runs packed CPU kernels with float32 "
                             f"activations; this engine has device {device.type}, dtype "
                             f"{dtype} and CPU kernels {'on' if quant_kernels() else 'off'} "
                             "(use --device cpu --dtype float32 or auto, KVSERVE_CPU_KERNELS=1)")
        if files_dir is not None and gguf_source(files_dir) is not None:
            logger.warning("quantization=%s on a GGUF checkpoint: its dequantised weights are "
                           "quantised again (auto keeps the file's own format)", scheme)
        return build_rtn(model, scheme, config.quantization_group_size)
    return build_quantised(model, packed) if scheme == "auto" and packed else None


def read_served_packed(config, device: torch.device, dtype: torch.dtype,
                       files_dir: Path | None) -> dict[str, Packed] | None:
    """The GGUF's packed tensors when ``quantization="auto"`` serves them (a GGUF source, real
    weights, the CPU kernels built, float32 activations on the CPU), else None."""
    if (not serves_packed_gguf(config, files_dir) or device.type != "cpu"
            or dtype != torch.float32):
        return None
    return read_packed(gguf_source(files_dir)) or None


def packed_only_reason(packed: dict[str, Packed], ram_bytes: int | None = None) -> str | None:
    """Why the packed weights must serve without float copies, or None (then the float model
    is built and the probe may keep it): ``KVSERVE_QUANT_PACKED_ONLY=1``, or float32 copies of
    the packed tensors too big for this machine (``engine.loading.packed_policy``: a
    multi-GB GGUF's float model cannot be held next to the packed one, so float is not a
    candidate and is not probed)."""
    if envs.quant_packed_only():
        return "KVSERVE_QUANT_PACKED_ONLY=1"
    return float_copies_too_big(sum(4 * p.shape[0] * p.shape[1] for p in packed.values()),
                                ram_bytes)


def adopt_packed_only(model: nn.Module, quantised: QuantisedModules, reason: str,
                      cpu_probe: str = "cached") -> Verdict:
    """Swap every packed module in without probing float (:func:`packed_only_reason`); only
    the packed modules' own settings are measured, cached per machine as any verdict
    (``cpu_probe`` as for :func:`adopt_if_faster`: ``background`` leaves them pending). Logged."""
    verdict, how = _cached_or_probed(model, quantised, envs.quant_force(), cpu_probe,
                                     float_allowed=False)
    apply_settings(quantised, verdict)
    n = apply(model, quantised)
    logger.info("quantization=auto: %d modules on packed weights for every batch size, "
                "float weights never built (%s)", n,
                "; ".join(t for t in (reason, verdict.describe(), how) if t))
    return verdict


def serves_packed_gguf(config, files_dir: Path | None) -> bool:
    """Whether ``quantization="auto"`` may keep this checkpoint's GGUF tensors packed (a GGUF
    source, real weights, the CPU kernels built): then the model runs float32 activations."""
    return (config.quantization == "auto" and config.load_format != "dummy"
            and files_dir is not None and quant_kernels() is not None
            and gguf_source(files_dir) is not None)


@torch.no_grad()
def build_rtn(model: nn.Module, scheme: str, group_size: int,
              head_scheme: str | None = None) -> QuantisedModules:
    """Every projection, the token table (so a tied head too) and an untied head of ``model``
    quantised (``quant_rtn.quantise``): the projections to ``scheme``, the table and head to
    ``head_scheme`` (default: :data:`HEAD_SCHEMES` of ``scheme``). A weight whose width does
    not split into ``group_size`` groups stays float (logged). Does not change ``model``."""
    out = QuantisedModules()
    head_scheme = head_scheme or HEAD_SCHEMES[scheme]
    skipped: list[str] = []

    def packed(weight: torch.Tensor, name: str, kind: str) -> Packed | None:
        if weight.shape[1] % group_size:
            skipped.append(name)
            return None
        return quantise(weight, kind, group_size)

    for i, layer in enumerate(model.layers):
        for attr in _FUSED:
            dense = getattr(layer, attr, None)
            if dense is None:  # a mixture-of-experts layer: experts below
                continue
            p = packed(dense.weight, f"layers.{i}.{attr}", scheme)
            if p is not None:
                out.linears[f"layers.{i}.{attr}"] = QuantLinear(p, dense.bias)
    table = packed(model.embed_tokens.weight, "embed_tokens", head_scheme)
    if table is not None:
        out.embedding = QuantEmbedding(table)
    if model.lm_head is not None:
        head = packed(model.lm_head.weight, "lm_head", head_scheme)
        if head is not None:
            out.linears["lm_head"] = QuantLinear(head)
    out.experts = rtn_experts(model, scheme, group_size)
    if skipped:
        logger.warning("quantization=%s: %d weights kept float, their width not a multiple of "
                       "%d (%s%s)", scheme, len(skipped), group_size, ", ".join(skipped[:4]),
                       ", ..." if len(skipped) > 4 else "")
    return out


def adopt(model: nn.Module, quantised: QuantisedModules, config) -> Verdict:
    """Step 2 for an engine. ``int4``/``int8``: every module swapped in now (call it before the
    float linears are packed, so none are packed in vain), logged; ``auto``:
    :func:`adopt_if_faster` (call it after)."""
    if config.quantization not in SCHEMES:
        return adopt_if_faster(model, quantised, config.cpu_probe)
    settings = measure_settings(quantised)
    n = apply(model, quantised)
    verdict = Verdict("quant", None, {}, settings)
    logger.info("quantization=%s (round-to-nearest, groups of %d): %d modules on packed "
                "weights, %.1f MiB, as requested (%s)", config.quantization,
                config.quantization_group_size, n, quantised.nbytes / 2**20,
                verdict.describe().removeprefix("; "))
    return verdict


# ``quantization=auto`` keeps a packed checkpoint's resident weights within this factor of
# their packed bytes (issue 65: a busy machine's probe once inflated a 107 MB GGUF to 623 MiB
# of float32); ``quantization=none`` is the explicit way to float weights.
AUTO_MEMORY_FACTOR = 1.3


def float_memory_reason(model: nn.Module, quantised: QuantisedModules,
                        factor: float = AUTO_MEMORY_FACTOR) -> str | None:
    """Why ``quantization=auto`` may not keep float weights for ``quantised``'s modules (a
    ``float`` or ``hybrid`` verdict), or None when it may: their float copies (and, hybrid,
    the packed weights beside them) would exceed ``factor`` times the packed bytes."""
    packed = quantised.nbytes
    floats = sum(_float_bytes(dense) for dense, _ in float_modules(model, quantised))
    if floats + packed <= factor * packed:
        return None
    return (f"float weights would take {floats / 2**20:.1f} MiB for {packed / 2**20:.1f} MiB "
            f"packed, more than the {factor}x that quantization=auto allows (--quantization "
            "none serves float)")


def _float_bytes(module: nn.Module) -> int:
    """A float module's float32 weight bytes: its ``weight``, or, packed for the CPU
    (``PackedLinear``, the weight held as panels), its shape's."""
    w = getattr(module, "weight", None)
    if w is not None:
        return w.numel() * 4
    return 4 * getattr(module, "out_features", 0) * getattr(module, "in_features", 0)


def adopt_if_faster(model: nn.Module, quantised: QuantisedModules,
                    cpu_probe: str = "cached") -> Verdict:
    """Steps 2 and 3 for an engine: swap the packed modules in for the row counts where the
    probe measured them faster (:func:`choose`), keeping the float modules for larger inputs
    when they lose there; log the verdict with its figures. ``KVSERVE_QUANT_FORCE=1`` uses the
    packed weights for every size whatever the probe says (tests). ``cpu_probe``
    (``--cpu-probe``): ``cached`` reuses this machine's verdict, ``force`` measures again, ``off``
    measures nothing: packed weights at every size with each setting's default;
    ``background``: as ``cached``, but a missing verdict is measured after start-up.

    The quantised path is used for every row count where float did not measure clearly faster
    (a verdict noise cannot flip: ``probe``'s docstring), and float weights are kept only within
    :data:`AUTO_MEMORY_FACTOR` of the packed bytes (a GGUF's 4-bit weights never qualify): for
    all row counts (``quant``, the float copies dropped), up to a crossover (``hybrid``), or for
    none (``float``); the prefill panels in the dtype measured faster."""
    force = envs.quant_force()
    memory = float_memory_reason(model, quantised)
    verdict, how = _cached_or_probed(model, quantised, force, cpu_probe,
                                     float_allowed=memory is None)
    if memory is not None:
        how = f"{how}; float not probed: {memory}"
    apply_settings(quantised, verdict)
    if verdict.mode == "float":
        logger.info("quantization=auto: keeping float weights, the quantised kernels are "
                    "slower on this machine (%s; %s)", verdict.describe(), how)
        return verdict
    n = apply(model, quantised, verdict.float_above)
    scope = ("every batch size" if verdict.float_above is None else
             f"up to {verdict.float_above} rows, float weights kept above (measured slower "
             "quantised there)")
    logger.info("quantization=auto: %d modules on packed weights for %s (%s)", n, scope,
                "; ".join(t for t in (verdict.describe(), how) if t))
    return verdict


def _cached_or_probed(model: nn.Module, quantised: QuantisedModules, force: bool,
                      cpu_probe: str = "cached", float_allowed: bool = True,
                      timer=None) -> tuple[Verdict, str]:
    """This machine's cached verdict for these modules (``engine.quantization.probe_cache``;
    not read when ``cpu_probe`` is ``force``), else, for ``background`` where float is not a
    candidate, the defaults with :attr:`Verdict.pending` set (``engine.weight_prep.background``
    measures them later), else a fresh :func:`choose` (``float_allowed``
    and ``timer`` passed on), cached only when its runs agreed (a busy machine's verdict, where
    undecided measurements kept the defaults, is measured again at the next start); and how
    it was obtained. ``off`` (unless ``force``): the defaults, nothing measured or read."""
    if cpu_probe == "off" and not force:
        return Verdict("quant", None, {}, {}), "--cpu-probe off: not measured, defaults"
    key = probe_cache.cache_key(_signature(quantised) + f"\nfloat_allowed={float_allowed}")
    entry = None if force else probe_cache.load(key, cpu_probe)
    if entry is not None:
        try:
            return (Verdict.from_dict(entry["verdict"]),
                    f"measured on this machine {entry.get('measured_at', '?')}, cached; "
                    "--cpu-probe force measures again")
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: measure
    if cpu_probe == "background" and not float_allowed and not force:
        return (Verdict("quant", None, {}, {}, pending=key),
                "not yet measured on this machine: the default kernels serve until the probe, "
                "run on idle steps once the server is ready, switches them")
    logger.info("start-up probe: measuring the packed kernels against float on this machine "
                "(once per machine and model, 20-60 s; --cpu-probe off skips it)")
    verdict = choose(model, quantised, force=force, float_allowed=float_allowed, timer=timer)
    if force:
        return verdict, "forced by KVSERVE_QUANT_FORCE=1"
    if verdict.confirmed:
        probe_cache.save(key, verdict.to_dict())
        return verdict, "measured now, cached for later starts"
    logger.warning("quantization=auto: some of the probe's runs disagreed after %d attempts "
                   "(another busy process?): where the candidates' ranges overlapped the "
                   "defaults hold (packed weights, each setting's first option); not cached, "
                   "the next start measures again", MAX_PROBE_ATTEMPTS)
    return verdict, "measured now on a busy machine (overlapping runs keep the defaults), not cached"


def _signature(quantised: QuantisedModules) -> str:
    """What the probe's outcome depends on in the modules: their paths, shapes and formats."""
    mods = dict(quantised.linears)
    if quantised.embedding is not None:
        mods["embed_tokens"] = quantised.embedding.head
    return "\n".join(f"{path}: {type(m).__name__}({m.extra_repr()})"
                     for path, m in sorted(mods.items()))
