"""The one entry point the model runner calls to give a freshly built model its weights.

:func:`prepare_weights` loads the checkpoint into the model (or dummy weights), applies
``config.quantization`` (``engine.weight_prep.apply``) and packs the float linears for this
device's linear backend (``engine.quantization.packed_linear``), in the one order that is
correct: ``auto`` on a GGUF whose float copies would not fit (``apply.packed_only_reason``):
every packed module swapped in without probing float; ``int4``/``int8``: quantised modules
swapped in *before* the float linears are packed (none packed in vain); ``auto`` otherwise:
float linears packed first, then the probe decides which row counts the packed modules serve
(``apply.adopt_if_faster``).

Under tensor parallelism (``tp_rank``) a GGUF's packed blocks are not split: ranks hold float
shards; ``int4``/``int8`` quantise each rank's shard. Last, the packed linears' activation
precision (``config.activation_precision``, ``engine.quantization.activation``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.loading.loader import iter_dir_weights
from engine.models.moe_model import stacked_names
from engine.quantization.activation import apply_activation_precision
from engine.quantization.packed_linear import linear_backend, linear_weight_bytes
from engine.quantization.probe import Verdict
from engine.weight_prep.activation_measure import stack_passes
from engine.weight_prep.apply import (
    adopt,
    adopt_packed_only,
    build_quantised,
    packed_only_reason,
    packed_replacements,
    read_served_packed,
)
from engine.weight_prep.background import BackgroundProbe


@dataclass(frozen=True)
class PreparedWeights:
    """What :func:`prepare_weights` decided. ``verdict``: which row counts run on packed
    quantised weights (None: no quantised module, e.g. ``quantization="none"``);
    ``linear_backend``: how the remaining float linears multiply (``"torch"``: plain
    ``nn.Linear``)."""

    verdict: Verdict | None
    linear_backend: str
    background: BackgroundProbe | None = None  # verdict.pending: measured after start-up


def prepare_weights(model: nn.Module, config, weights, *, device: torch.device,
                    dtype: torch.dtype, files_dir: Path | None,
                    tp_rank: bool = False) -> PreparedWeights:
    """Load ``weights`` (an iterator of ``(name, tensor)``; closed unread when the packed
    tensors serve alone) into ``model`` (built on ``device`` in ``dtype``, storage allocated),
    put it in eval mode, quantise and pack its linears as ``config`` asks. ``files_dir``: the
    model's (converted) directory, whose GGUF source ``quantization="auto"`` reads.
    ``tp_rank``: ``model`` is one tensor-parallel rank's shard. A verdict left pending
    (``--cpu-probe background``) comes with its :class:`BackgroundProbe`. ValueError when the
    requested quantisation cannot run here (``apply.packed_replacements``) or a packed weight
    does not match its float copy."""
    packed = read_served_packed(config, device, dtype, files_dir) if not tp_rank else None
    packed_only = packed_only_reason(packed) if packed else None
    if config.load_format == "dummy":
        model.init_dummy_weights(seed=config.seed)
    elif packed_only:  # the packed tensors' float parameters are never read nor touched
        if hasattr(weights, "close"):
            weights.close()
        skip = {*packed, *stacked_names(packed)}  # experts: their stacked float copies too
        model.load_weights(iter_dir_weights(files_dir, skip=skip), skip=skip)
    else:
        model.load_weights(weights)
    model.eval()
    verdict = None
    quantised = served = None  # served: the packed modules swapped in (the probe's)
    if packed_only:
        served = build_quantised(model, packed, check=False)
        verdict = adopt_packed_only(model, served, packed_only, config.cpu_probe)
    elif not tp_rank or config.quantization != "auto":  # auto keeps a rank's shards float
        quantised = packed_replacements(model, config, device, dtype, files_dir, packed)
    if quantised and config.quantization != "auto":  # explicit int4/int8: before packing
        verdict = adopt(model, quantised, config)
    backend = linear_backend(device, dtype, linear_weight_bytes(model)) or "torch"
    if backend != "torch":
        model.pack_linears(backend)
    if quantised and config.quantization == "auto":  # the probe compares packed float
        verdict = adopt(model, quantised, config)
    if verdict is not None and verdict.mode != "float":  # --activation-precision, logged
        apply_activation_precision(model, getattr(config, "activation_precision", "auto"),
                                   config.quantization,
                                   None if config.cpu_probe == "off" else stack_passes,
                                   invariant=config.batch_invariant)
    background = None
    if verdict is not None and verdict.pending is not None:
        background = BackgroundProbe(served or quantised, verdict.pending)
    return PreparedWeights(verdict, backend, background)
