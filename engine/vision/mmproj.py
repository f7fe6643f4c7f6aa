"""Reading llama.cpp's ``mmproj`` GGUF of Gemma 3 (the SigLIP tower and the projector that
``llama-server --mmproj`` runs) into kvserve's ``ImageEncoder``.

``read_mmproj(path) -> (VisionConfig, tensors)`` gives the config and the tensors under the
names of Gemma 3's published checkpoints (``vision_tower.vision_model.*`` and
``multi_modal_projector.*``, one of ``weights.LAYOUTS``), in float32, with what llama.cpp's
converter did to them undone; ``load_mmproj_encoder(path)`` builds the float32 CPU encoder.

The format, as llama.cpp writes and reads it (``conversion/gemma.py`` ``Gemma3VisionModel``,
``conversion/base.py`` ``MmprojModel`` and ``ModelBase.prepare_tensors``, the tensor map of
``gguf-py/gguf/tensor_mapping.py``; ``tools/mtmd/clip.cpp``, ``clip-impl.h`` and
``models/siglip.cpp`` read it):

* metadata: ``clip.projector_type = "gemma3"`` (``clip.vision.projector_type`` in files of
  mixed modalities), ``clip.has_vision_encoder``, ``clip.use_gelu`` (the tanh GELU; without it
  llama.cpp would run GELU-quick), and under ``clip.vision.``: ``image_size``, ``patch_size``,
  ``embedding_length``, ``feed_forward_length``, ``block_count``, ``attention.head_count``,
  ``attention.layer_norm_epsilon``, ``projection_dim`` (the text model's width),
  ``image_mean`` / ``image_std``; all of these llama.cpp requires. The soft tokens per image are
  not stored: the projector average-pools the patch grid in squares of
  ``clip.vision.projector.scale_factor`` patches a side, a key written only when it is not
  Gemma 3's 4 (64 patches a side pooled to 16: 256 tokens), so a missing key means 4.
* tensors: ``v.patch_embd.{weight,bias}`` (the conv, ``[hidden, 3, p, p]``),
  ``v.position_embd.weight``, ``v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,
  ffn_down}.{weight,bias}`` (``ffn_up`` is SigLIP's ``fc1``, ``ffn_down`` its ``fc2``),
  ``v.post_ln.{weight,bias}``, ``mm.input_projection.weight`` and ``mm.soft_emb_norm.weight``.
  Shapes are HF's (GGUF lists them reversed; gguf-py gives them back in HF's order), the
  projection included: ``[hidden, text_hidden]``, not transposed (``siglip.cpp`` transposes it
  when it multiplies).
* values: ``mm.soft_emb_norm.weight`` holds ``1 + w`` (Gemma's RMSNorm gain folded in: the
  converter adds 1), undone here. Storage types vary: the embeddings are forced to F32, the
  projection to F16 whatever the output type (llama.cpp issue 13025), norms and biases F32,
  the rest F32, F16, BF16 or Q8_0 (a tensor whose rows Q8_0 cannot block falls back to F16);
  all are dequantised with ``gguf.quants.dequantize``.
* the first Gemma 3 mmproj files came from a since-removed script
  (``examples/llava/gemma3_convert_encoder_to_gguf.py``) that named ``fc1`` ``ffn_down`` and
  ``fc2`` ``ffn_up``; ``clip.cpp`` recognises them by shape (``ffn_down`` whose input width is
  the hidden size) and swaps the pair back, and so does this reader (when the MLP's width equals
  the hidden size the shapes cannot tell, and the names are taken at their word).

Any key or tensor missing, a tensor misshapen or left over, another projector type: a
``ValueError`` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.vision.config import VisionConfig
from engine.vision.encoder import ImageEncoder
from engine.vision.weights import load_image_encoder

PROJECTOR_TYPE = "gemma3"
# clip.cpp's default for Gemma 3 (every published size): 4x4 patches pooled into one token.
DEFAULT_SCALE_FACTOR = 4
TOWER = "vision_tower.vision_model."
PROJECTOR = "multi_modal_projector."
# GGUF name in a block -> SigLIP's name below encoder.layers.N.
_BLOCK_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}
_GLOBAL = {
    "v.patch_embd.weight": TOWER + "embeddings.patch_embedding.weight",
    "v.patch_embd.bias": TOWER + "embeddings.patch_embedding.bias",
    "v.position_embd.weight": TOWER + "embeddings.position_embedding.weight",
    "v.post_ln.weight": TOWER + "post_layernorm.weight",
    "v.post_ln.bias": TOWER + "post_layernorm.bias",
    "mm.input_projection.weight": PROJECTOR + "mm_input_projection_weight",
    "mm.soft_emb_norm.weight": PROJECTOR + "mm_soft_emb_norm.weight",
}
SOFT_EMB_NORM = "mm.soft_emb_norm.weight"
PROJECTION = "mm.input_projection.weight"


def gguf_names(num_layers: int) -> dict[str, str]:
    """The mmproj's tensor name -> the published checkpoint's name, for ``num_layers`` blocks."""
    names = dict(_GLOBAL)
    for i in range(num_layers):
        for part, hf in _BLOCK_PARTS.items():
            for kind in ("weight", "bias"):
                names[f"v.blk.{i}.{part}.{kind}"] = f"{TOWER}encoder.layers.{i}.{hf}.{kind}"
    return names


def read_mmproj(path: str | Path) -> tuple[VisionConfig, dict[str, torch.Tensor]]:
    """The ``VisionConfig`` and the float32 tower and projector tensors (published HF names) of
    the Gemma 3 mmproj GGUF at ``path``."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read {path} as GGUF: {exc}") from exc
    meta = _Metadata(reader, path)
    _check_kind(meta)

    hidden = meta.integer("clip.vision.embedding_length")
    num_layers = meta.integer("clip.vision.block_count")
    tensors = {t.name: t for t in reader.tensors}
    names = gguf_names(num_layers)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path}: tensor {missing[0]} is missing from the mmproj"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    surplus = sorted(set(tensors) - set(names))
    if surplus:
        raise ValueError(f"{path}: unexpected tensors for a Gemma 3 mmproj with {num_layers} "
                         f"blocks: {surplus[:5]}")

    out: dict[str, torch.Tensor] = {}
    for gguf_name, hf_name in names.items():
        value = _float32(tensors[gguf_name])
        if gguf_name == SOFT_EMB_NORM:
            value = value - 1.0  # the converter stored Gemma's gain 1 + w
        out[hf_name] = value
    _unswap_legacy_mlp(out, num_layers, hidden)

    projection = out[PROJECTOR + "mm_input_projection_weight"]
    if projection.dim() != 2 or projection.shape[0] != hidden:
        raise ValueError(f"{path}: {PROJECTION} has shape {list(projection.shape)}, expected "
                         f"[{hidden}, text width]")
    text_hidden = int(projection.shape[1])
    projection_dim = meta.integer("clip.vision.projection_dim")
    if projection_dim != text_hidden:
        raise ValueError(f"{path}: clip.vision.projection_dim is {projection_dim} but "
                         f"{PROJECTION} projects to {text_hidden}")

    image_size = meta.integer("clip.vision.image_size")
    patch_size = meta.integer("clip.vision.patch_size")
    scale = meta.integer("clip.vision.projector.scale_factor", DEFAULT_SCALE_FACTOR)
    if patch_size <= 0 or image_size % patch_size:
        raise ValueError(f"{path}: clip.vision.image_size {image_size} is not a multiple of "
                         f"clip.vision.patch_size {patch_size}")
    per_side = image_size // patch_size
    if scale <= 0 or per_side % scale:
        # llama.cpp's pooling would drop the remainder; our projector pools evenly or not at all.
        raise ValueError(f"{path}: clip.vision.projector.scale_factor {scale} does not divide "
                         f"the {per_side} patches per side")
    config = VisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden,
        intermediate_size=meta.integer("clip.vision.feed_forward_length"),
        num_layers=num_layers,
        num_heads=meta.integer("clip.vision.attention.head_count"),
        mm_tokens_per_image=(per_side // scale) ** 2,
        text_hidden_size=text_hidden,
        layer_norm_eps=meta.number("clip.vision.attention.layer_norm_epsilon"),
        image_mean=meta.numbers("clip.vision.image_mean"),
        image_std=meta.numbers("clip.vision.image_std"),
    )
    return config, out


def load_mmproj_encoder(path: str | Path) -> ImageEncoder:
    """A float32 CPU ``ImageEncoder`` with the weights of the Gemma 3 mmproj GGUF at ``path``."""
    config, tensors = read_mmproj(path)
    return load_image_encoder(config, tensors)


class _Metadata:
    """Typed access to the GGUF's key-value fields; a missing or mistyped one is a ValueError
    naming it."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self.fields:
            raise ValueError(f"{self.path}: key {key} is missing from the mmproj's metadata")
        return self.get(key)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{self.path}: {key} must be an integer, got {value!r}")
        return int(value)

    def number(self, key: str) -> float:
        value = self.need(key)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError(f"{self.path}: {key} must be a number, got {value!r}")
        return _shortest(value)

    def numbers(self, key: str) -> tuple[float, ...]:
        value = self.need(key)
        if not isinstance(value, list) or len(value) != 3:
            raise ValueError(f"{self.path}: {key} must be 3 numbers (R, G, B), got {value!r}")
        return tuple(_shortest(v) for v in value)


def _shortest(value) -> float:
    """A float32 field as the shortest decimal that reads back as the same float32 (1e-06, not
    9.99999997e-07): the value the converter was given, whenever float32 could hold it. A
    value float32 cannot hold exactly (a float64 field) is kept as it is."""
    single = np.float32(value)
    return float(str(single)) if float(single) == float(value) else float(value)


def _check_kind(meta: _Metadata) -> None:
    """A Gemma 3 vision projector with a GELU-tanh tower, or ValueError saying what it is."""
    kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    if kind is None:
        arch = meta.get("general.architecture")
        raise ValueError(f"{meta.path}: key clip.projector_type is missing: not a llama.cpp "
                         f"mmproj file (general.architecture is {arch!r})")
    if kind != PROJECTOR_TYPE:
        raise ValueError(f"{meta.path}: the mmproj's projector type is {kind!r}; only Gemma 3's "
                         f"({PROJECTOR_TYPE!r}) is supported")
    if meta.need("clip.has_vision_encoder") is not True:
        raise ValueError(f"{meta.path}: clip.has_vision_encoder is not true: no vision encoder")
    if meta.get("clip.use_gelu") is not True or meta.get("clip.use_silu") is True:
        raise ValueError(f"{meta.path}: clip.use_gelu is not true: llama.cpp would run another "
                         f"activation than the tanh GELU SigLIP uses (and the encoder implements)")


def _float32(tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        data = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {tensor.name} is stored as {qtype.name}, which cannot be "
                         f"dequantised here") from exc
    return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))


def _unswap_legacy_mlp(out: dict[str, torch.Tensor], num_layers: int, hidden: int) -> None:
    """Files of the legacy Gemma 3 script hold fc1 as ffn_down and fc2 as ffn_up: seen, as
    clip.cpp sees it, in an ffn_down weight taking the hidden width ([intermediate, hidden])."""
    for i in range(num_layers):
        fc1, fc2 = (f"{TOWER}encoder.layers.{i}.mlp.{fc}" for fc in ("fc1", "fc2"))
        up_w, down_w = out[fc1 + ".weight"], out[fc2 + ".weight"]
        if down_w.dim() != 2 or up_w.dim() != 2 or down_w.shape[1] != hidden \
                or down_w.shape[0] == hidden:
            continue  # as named (or the shapes cannot tell)
        for kind in ("weight", "bias"):
            out[fc1 + "." + kind], out[fc2 + "." + kind] = (out[fc2 + "." + kind],
                                                            out[fc1 + "." + kind])
