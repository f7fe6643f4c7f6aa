"""Loading Gemma 3's vision tower and projector from a HF state dict or safetensors files.

Checkpoints name the same tensors under four layouts, which ``load_weights`` all accepts:

* ``vision_tower.vision_model.*`` + ``multi_modal_projector.*``: Gemma 3's published files;
* ``model.vision_tower.vision_model.*`` + ``model.multi_modal_projector.*``: transformers 4's
  ``Gemma3Model`` in memory (its ``state_dict()``);
* ``model.vision_tower.*`` + ``model.multi_modal_projector.*``: transformers 5 in memory;
* ``vision_tower.*`` + ``multi_modal_projector.*``: transformers 5's ``save_pretrained``.

Below the tower's prefix the names are SigLIP's (``embeddings.patch_embedding.weight``,
``encoder.layers.N.self_attn.q_proj.weight``, ``post_layernorm.bias``, ...). Every tensor the
encoder needs must be present with its exact shape, else ``ValueError`` names it; a tower or
projector tensor the encoder has no place for (a layer beyond ``num_layers``) is refused the
same way, except SigLIP's pooling ``head.*`` that Gemma 3 does not use. Tensors outside the
two prefixes (the language model) are ignored and, from files, never read. Values are copied
into the encoder's float32 parameters whatever their stored dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.vision.config import VisionConfig
from engine.vision.encoder import ImageEncoder

# (tower prefix, projector prefix), most specific first: "model.vision_tower.vision_model."
# must be tried before "model.vision_tower.", whose names it would otherwise shadow.
LAYOUTS: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.vision_model.", "model.multi_modal_projector."),
    ("vision_tower.vision_model.", "multi_modal_projector."),
    ("model.vision_tower.", "model.multi_modal_projector."),
    ("vision_tower.", "multi_modal_projector."),
)
_PROBE = "embeddings.patch_embedding.weight"
# Tower tensors a checkpoint may carry that the encoder does not use.
_UNUSED_TOWER = ("head.", "embeddings.position_ids")


def checkpoint_names(config: VisionConfig) -> dict[str, str]:
    """Our parameter name -> the checkpoint's name below its tower or projector prefix; the
    projector's names start with ``projector:`` to tell them apart."""
    names = {
        "tower.patch_embedding.weight": "embeddings.patch_embedding.weight",
        "tower.patch_embedding.bias": "embeddings.patch_embedding.bias",
        "tower.position_embedding": "embeddings.position_embedding.weight",
        "tower.post_layernorm.weight": "post_layernorm.weight",
        "tower.post_layernorm.bias": "post_layernorm.bias",
        "projector.norm.weight": "projector:mm_soft_emb_norm.weight",
        "projector.projection": "projector:mm_input_projection_weight",
    }
    for i in range(config.num_layers):
        for part in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            for kind in ("weight", "bias"):
                names[f"tower.layers.{i}.{part}.{kind}"] = f"encoder.layers.{i}.{part}.{kind}"
    return names


def find_layout(keys) -> tuple[str, str]:
    """The (tower, projector) prefixes of the layout ``keys`` use; ``ValueError`` if none."""
    keys = set(keys)
    for tower, projector in LAYOUTS:
        if tower + _PROBE in keys:
            return tower, projector
    raise ValueError("no Gemma 3 vision tower in the checkpoint: none of "
                     + ", ".join(t + _PROBE for t, _ in LAYOUTS) + " is present")


def _full_name(name: str, tower: str, projector: str) -> str:
    if name.startswith("projector:"):
        return projector + name.removeprefix("projector:")
    return tower + name


def load_weights(encoder: ImageEncoder, tensors: Mapping[str, torch.Tensor]) -> ImageEncoder:
    """Copy the checkpoint's tower and projector tensors into ``encoder``; returns it."""
    tower, projector = find_layout(tensors.keys())
    names = checkpoint_names(encoder.config)
    expected = {_full_name(theirs, tower, projector): ours for ours, theirs in names.items()}
    unexpected = sorted(
        k for k in tensors
        if (k.startswith(tower) or k.startswith(projector)) and k not in expected
        and not k.removeprefix(tower).startswith(_UNUSED_TOWER))
    if unexpected:
        raise ValueError(f"unexpected vision tensors (does the config match the checkpoint?): "
                         f"{unexpected[:5]}")
    params = dict(encoder.named_parameters())
    with torch.no_grad():
        for theirs, ours in expected.items():
            if theirs not in tensors:
                raise ValueError(f"checkpoint tensor {theirs} is missing")
            value, param = tensors[theirs], params[ours]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint tensor {theirs} has shape {list(value.shape)}, "
                                 f"expected {list(param.shape)}")
            param.copy_(value.to(dtype=param.dtype, device=param.device))
    return encoder


def read_vision_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tower and projector tensors of a ``.safetensors`` file or of every such file in a
    directory (sharded checkpoints), read lazily: the language model's tensors stay on disk.
    ``ValueError`` when the path holds no safetensors file."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"no .safetensors file at {path}")
    prefixes = tuple(sorted({p for layout in LAYOUTS for p in layout}))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out


def load_image_encoder(config: VisionConfig,
                       source: Mapping[str, torch.Tensor] | str | Path) -> ImageEncoder:
    """A float32 CPU ``ImageEncoder`` with the weights of ``source``: a state dict, or a
    safetensors file or directory."""
    tensors = source if isinstance(source, Mapping) else read_vision_tensors(source)
    return load_weights(ImageEncoder(config), tensors)
