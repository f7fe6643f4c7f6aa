"""Reading a PEFT LoRA adapter directory (what ``PeftModel.save_pretrained`` writes).

``read_peft_dir(name, path)`` reads ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``, loaded with ``weights_only=True``) into a :class:`LoRAAdapter`.
Weight keys look like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; the
``base_model.model.`` prefix may be absent and ``.lora_A.default.weight`` is accepted too.

Scale: PEFT multiplies each module's ``B @ A`` by ``alpha / r`` (``alpha / sqrt(r)`` with
``use_rslora``), where ``r`` and ``alpha`` come from ``rank_pattern`` / ``alpha_pattern`` when
a pattern matches the module (PEFT's rule: ``re.match(rf"(.*\\.)?({pattern})$", module)``,
first matching pattern in file order), else from ``r`` / ``lora_alpha``. When every pair has
the same scale it is the adapter's ``scaling`` and B is kept as stored; otherwise ``scaling``
is 1.0 and each B is pre-multiplied by its own scale, so that ``scaling * B @ A`` is PEFT's
delta for every pair either way.

``fan_in_fan_out`` needs no transpose here: PEFT's ``lora_A`` / ``lora_B`` are always
``nn.Linear`` weights (``[r, in]``, ``[out, r]``); the flag only says that the *base* weight is
a transposed ``Conv1D`` (GPT-2), and PEFT turns it off for ``nn.Linear`` targets, which all
seven served projections are.

Refused (ValueError saying what to do instead): a ``peft_type`` other than LORA, DoRA, LoRA
biases (``bias`` other than "none", ``lora_bias``), ``modules_to_save``, trainable tokens,
targets outside the seven projections of the decoder layers (``lm_head``, ``embed_tokens``,
MoE experts, ...), variants that change the forward pass (aLoRA, QALoRA, block-diagonal
LoRA, layer replication, ``target_parameters``), missing files, an A without its B (or the
reverse), and a pair whose rank differs from the one the config gives it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from engine.lora.adapter import TARGETS, LoRAAdapter

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

_GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?"
    r"(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\.(?P<target>\w+))"
    r"\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_MERGE_HINT = ("merge the adapter into the base model (PeftModel.merge_and_unload()) and serve "
               "the merged checkpoint, or retrain it as a plain LoRA of "
               + ", ".join(TARGETS))
# Config options whose adapters compute something other than ``x W^T + s (x A^T) B^T``.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "kasa_config": "KaSA (kasa_config)",
}


def read_peft_dir(name: str, path: Path) -> LoRAAdapter:
    """The adapter in PEFT directory ``path``, served under ``name`` (module docstring).

    Raises ValueError for anything it cannot serve exactly, naming the file and the reason."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory; a PEFT adapter is a "
                         f"directory with {CONFIG_FILE} and {SAFETENSORS_FILE} (or {BIN_FILE})")
    config = read_config(name, path)
    tensors = read_tensors(name, path)
    pairs = collect_pairs(name, path, tensors)
    scales = {key: pair_scale(name, path, config, module, a.shape[0])
              for key, (module, a, _) in pairs.items()}
    distinct = set(scales.values())
    if len(distinct) == 1:
        scaling = distinct.pop()
        weights = {key: (a, b) for key, (_, a, b) in pairs.items()}
    else:  # per-module scales: fold each into its B (module docstring)
        scaling = 1.0
        weights = {key: (a, b * scales[key]) for key, (_, a, b) in pairs.items()}
    rank = max(a.shape[0] for a, _ in weights.values())
    base = config.get("base_model_name_or_path")
    return LoRAAdapter(name=name, path=str(path), rank=int(rank), scaling=float(scaling),
                       weights=weights, base_model=str(base) if base else None)


def read_config(name: str, path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of ``path``, checked for what kvserve can serve."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}; a PEFT adapter "
                         f"directory holds {CONFIG_FILE} and {SAFETENSORS_FILE} (or {BIN_FILE}), "
                         "as PeftModel.save_pretrained writes them")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    where = f"LoRA adapter {name!r} ({file})"
    peft_type = config.get("peft_type", "LORA" if "r" in config else None)
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where} is a {peft_type} adapter; kvserve serves LoRA adapters "
                         "(peft_type LORA) only")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"{where} uses {what}, which kvserve does not serve; {_MERGE_HINT}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"{where} trains biases (bias: {bias!r}), which kvserve does not serve; "
                         f"{_MERGE_HINT}")
    if config.get("modules_to_save"):
        raise ValueError(f"{where} saves whole modules besides the LoRA pairs (modules_to_save: "
                         f"{config['modules_to_save']}), which kvserve does not serve; "
                         f"{_MERGE_HINT}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        # PEFT matches an entry against the end of a module name ("self_attn.q_proj" too)
        outside = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in TARGETS)
        if outside:
            raise ValueError(f"{where} targets {', '.join(outside)}; kvserve serves adapters of "
                             f"{', '.join(TARGETS)} only: retrain without those targets, or "
                             "merge the adapter into the base model and serve the merged "
                             "checkpoint")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"{where}: r must be a positive integer, not {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, not {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise ValueError(f"{where}: {key} must be an object (module pattern -> number)")
    return config


def read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    """The adapter's weight file: safetensors when present, else the pickled ``.bin``
    (``weights_only``: no code runs)."""
    st, pt = path / SAFETENSORS_FILE, path / BIN_FILE
    try:
        if st.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(st), device="cpu")
        elif pt.is_file():
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"LoRA adapter {name!r}: no {SAFETENSORS_FILE} or {BIN_FILE} in "
                             f"{path}; copy the adapter's weight file next to {CONFIG_FILE}")
    except ValueError:
        raise
    except Exception as e:  # a corrupt file, a pickle with more than tensors, ...
        raise ValueError(f"LoRA adapter {name!r}: cannot read the weights in {path}: {e}") from e
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor)
                                                for t in tensors.values()):
        raise ValueError(f"LoRA adapter {name!r}: the weight file in {path} is not a mapping "
                         "of names to tensors")
    return tensors


def collect_pairs(name: str, path: Path, tensors: dict[str, torch.Tensor],
                  ) -> dict[tuple[int, str], tuple[str, torch.Tensor, torch.Tensor]]:
    """(layer, target) -> (module name for the patterns, A, B) in float32; ValueError for
    a key that is no served LoRA factor and for an A without B (or B without A)."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    unknown: list[str] = []
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m["target"] not in _GROUPS[m["group"]]:
            unknown.append(key)
            continue
        pair = (int(m["layer"]), m["target"])
        if m["ab"] in halves.setdefault(pair, {}):
            raise ValueError(f"LoRA adapter {name!r} ({path}): two lora_{m['ab']} tensors for "
                             f"layer {pair[0]} {pair[1]} (e.g. {key}); save one adapter per "
                             "directory")
        halves[pair][m["ab"]] = tensor.detach().to(torch.float32).contiguous()
        modules[pair] = m["module"]
    if unknown:
        raise ValueError(unknown_keys_message(name, path, sorted(unknown)))
    if not halves:
        raise ValueError(f"LoRA adapter {name!r} ({path}): the weight file holds no LoRA "
                         "tensors")
    out = {}
    for pair in sorted(halves):
        found = halves[pair]
        if set(found) != {"A", "B"}:
            have, lack = ("A", "B") if "A" in found else ("B", "A")
            raise ValueError(f"LoRA adapter {name!r} ({path}): layer {pair[0]} {pair[1]} has "
                             f"lora_{have} but no lora_{lack}; the weight file is incomplete")
        out[pair] = (modules[pair], found["A"], found["B"])
    return out


def unknown_keys_message(name: str, path: Path, keys: list[str]) -> str:
    """Why the tensors ``keys`` cannot be served, with the likely cause."""
    joined = " ".join(keys)
    if "lora_magnitude_vector" in joined:
        cause = f"DoRA magnitudes: {_MERGE_HINT}"
    elif "embed" in joined or "lm_head" in joined:
        cause = ("embedding or output-head weights (new tokens, or lm_head / embed_tokens "
                 f"targets): kvserve serves adapters of {', '.join(TARGETS)} only; "
                 f"{_MERGE_HINT}")
    elif "modules_to_save" in joined:
        cause = f"whole saved modules: {_MERGE_HINT}"
    else:
        cause = (f"kvserve serves LoRA pairs (lora_A / lora_B) on {', '.join(TARGETS)} of the "
                 "decoder layers (model.layers.N.self_attn / .mlp) only")
    shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return f"LoRA adapter {name!r} ({path}) holds tensors kvserve cannot serve ({shown}): {cause}"


def pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's ``get_pattern_key`` rule: the first pattern ``p`` (file order) with
    ``re.match(rf"(.*\\.)?({p})$", module)`` gives the value, else ``default``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return float(default)


def pair_scale(name: str, path: Path, config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scale of ``module``: alpha / r, or alpha / sqrt(r) with rsLoRA; ValueError
    when the stored A's rank is not the config's rank for it (PEFT could not load it)."""
    try:
        r = pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    except re.error as e:
        raise ValueError(f"LoRA adapter {name!r} ({path / CONFIG_FILE}): a rank_pattern or "
                         f"alpha_pattern key is not a valid regular expression: {e}") from e
    if int(r) != rank:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {module} has rank {rank} in the "
                         f"weights but {int(r)} in {CONFIG_FILE} (r / rank_pattern); the two "
                         "files do not belong together")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
