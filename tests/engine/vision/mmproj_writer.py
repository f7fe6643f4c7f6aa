"""The test's truth for llama.cpp's Gemma 3 mmproj GGUF: writers restating llama.cpp's two
converters, step by step, from a HF ``Gemma3ForConditionalGeneration``.

``write_mmproj`` restates ``convert_hf_to_gguf.py --mmproj`` (now split into
``conversion/base.py`` and ``conversion/gemma.py``): ``Gemma3VisionModel.filter_tensors``,
``.modify_tensors``, ``.tensor_force_quant`` and ``.set_gguf_parameters``, over
``MmprojModel.set_gguf_parameters`` and ``ModelBase.prepare_tensors`` (its choice of storage
type per tensor), naming tensors through gguf-py's own ``TensorNameMap`` as
``ModelBase.map_tensor_name`` does. ``write_legacy_mmproj`` restates the removed
``examples/llava/gemma3_convert_encoder_to_gguf.py`` (``Gemma3VisionTower``), which produced
the first published Gemma 3 mmproj files. Both read the checkpoint under its published names
(``vision_tower.vision_model.*``, ``multi_modal_projector.*``), as the converters read the
safetensors files. Knobs for the tests (dropping a key or a tensor, overriding a key) act on the
finished writer, after the converter's own steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import torch

OUTTYPES = {  # --outtype -> gguf.LlamaFileType, as convert_hf_to_gguf.py's ftype_map
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def published_state(model) -> dict[str, torch.Tensor]:
    """The tower and projector tensors of ``model`` under the names of Gemma 3's published
    safetensors (what the converters read), in float32."""
    out = {}
    for name, value in model.state_dict().items():
        for prefix, published in (("model.vision_tower.vision_model.", "vision_tower.vision_model."),
                                  ("model.vision_tower.", "vision_tower.vision_model."),
                                  ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(prefix):
                out[published + name.removeprefix(prefix)] = value.detach().float().clone()
                break
    return out


def default_preprocessor(model) -> dict[str, Any]:
    """Gemma 3's preprocessor_config.json: mean and std 0.5, one image as
    ``mm_tokens_per_image`` tokens."""
    return {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "image_seq_length": model.config.mm_tokens_per_image}


def write_mmproj(model, path: str | Path, *, outtype: str = "f16",
                 preprocessor: Mapping[str, Any] | None = None,
                 edit: Callable[[gguf.GGUFWriter], None] | None = None,
                 drop_tensors: Iterable[str] = ()) -> Path:
    """The mmproj ``convert_hf_to_gguf.py --mmproj --outtype <outtype>`` writes for ``model``
    (``preprocessor``: its preprocessor_config.json). ``edit`` may change the writer's metadata
    before the file is written; ``drop_tensors`` leaves tensors (GGUF names) out."""
    config = model.config.to_dict()
    vision = config["vision_config"]
    ftype = OUTTYPES[outtype]
    preprocessor = dict(preprocessor or default_preprocessor(model))
    drop = set(drop_tensors)
    # ModelBase.__init__: GGUFWriter(arch=MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ]), i.e. "clip".
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    # MmprojModel.__init__: block_count from the vision config, gguf-py's MMPROJ tensor map.
    block_count = vision["num_hidden_layers"]
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, block_count)

    # ModelBase.prepare_tensors over Gemma3VisionModel's filter / modify / force_quant.
    for name, data_torch in published_state(model).items():
        item = _gemma3_filter_tensors(name)
        if item is None:
            continue
        name = item
        if data_torch.dtype not in (torch.float16, torch.float32):
            data_torch = data_torch.to(torch.float32)
        # Gemma3VisionModel.modify_tensors: only the projector's Gemma RMSNorm gets its + 1.
        if "soft_emb_norm.weight" in name:
            data_torch = data_torch + 1
        # ModelBase.modify_tensors -> map_tensor_name (try_suffixes .weight, .bias)
        new_name = tensor_map.get_name(key=name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"Can not map tensor {name!r}")
        if new_name in drop:
            continue
        data = data_torch.numpy()
        n_dims = len(data.shape)
        data_qtype = _gemma3_tensor_force_quant(name)
        # "Most of the codebase that takes in 1D tensors or norms only handles F32 tensors"
        if n_dims <= 1 or new_name.endswith("_norm.weight"):
            data_qtype = gguf.GGMLQuantizationType.F32
        # (the always-F32 list: of its entries only V_ENC_EMBD_POS exists in an mmproj)
        if data_qtype is False and (
                new_name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_POS] + ".weight"
                or new_name[-7:] not in (".weight", ".lora_a", ".lora_b")):
            data_qtype = gguf.GGMLQuantizationType.F32
        if isinstance(data_qtype, bool):
            data_qtype = _ftype_qtype(ftype)
        try:
            data = gguf.quants.quantize(data, data_qtype)
        except gguf.QuantError:  # "falling back to F16"
            data_qtype = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(data, data_qtype)
        writer.add_tensor(new_name, data, raw_dtype=data_qtype)

    # ModelBase.prepare_metadata: set_type, (general.* naming metadata), set_gguf_parameters.
    writer.add_type(gguf.GGUFType.MMPROJ)
    # MmprojModel.set_gguf_parameters
    writer.add_file_type(ftype)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(block_count)
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    # Gemma3VisionModel.set_gguf_parameters
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    image_seq_length = preprocessor.get("image_seq_length", 256)
    n_per_side = int(image_seq_length ** 0.5)
    proj_scale_factor = (vision["image_size"] // vision["patch_size"]) // n_per_side
    if proj_scale_factor > 0 and proj_scale_factor != 4:
        writer.add_vision_projector_scale_factor(proj_scale_factor)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return _finish(writer, path, edit)


def _gemma3_filter_tensors(name: str) -> str | None:
    """Gemma3VisionModel.filter_tensors (then ModelBase.filter_tensors, a no-op here)."""
    if "vision_model.head." in name:
        return None
    if not name.startswith(("multi_modal_projector.", "vision_tower.", "multimodal_projector.",
                            "vision_model.")):
        return None
    return name.replace("_weight", ".weight")


def _gemma3_tensor_force_quant(name: str):
    """Gemma3VisionModel.tensor_force_quant (llama.cpp issue 13025)."""
    if "input_projection" in name:
        return gguf.GGMLQuantizationType.F16
    if ".embeddings." in name:
        return gguf.GGMLQuantizationType.F32
    return False


def _ftype_qtype(ftype: gguf.LlamaFileType) -> gguf.GGMLQuantizationType:
    return {
        gguf.LlamaFileType.ALL_F32: gguf.GGMLQuantizationType.F32,
        gguf.LlamaFileType.MOSTLY_F16: gguf.GGMLQuantizationType.F16,
        gguf.LlamaFileType.MOSTLY_BF16: gguf.GGMLQuantizationType.BF16,
        gguf.LlamaFileType.MOSTLY_Q8_0: gguf.GGMLQuantizationType.Q8_0,
    }[ftype]


def write_legacy_mmproj(model, path: str | Path, *, outtype: str = "f16") -> Path:
    """The mmproj ``examples/llava/gemma3_convert_encoder_to_gguf.py`` (Gemma3VisionTower)
    wrote: fixed mean and std, the projection quantised like any matrix, and SigLIP's fc1 named
    ffn_down, fc2 ffn_up."""
    config = model.config.to_dict()
    text, vision = config["text_config"], config["vision_config"]
    ftype = OUTTYPES[outtype]
    writer = gguf.GGUFWriter(path=None, arch="clip")
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", False)
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.projection_dim", text["hidden_size"])
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_float32("clip.vision.attention.layer_norm_epsilon",
                       vision.get("layer_norm_eps", 1e-6))
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    for name, data_torch in published_state(model).items():  # Gemma3VisionTower.add_tensor
        is_1d = len(data_torch.shape) == 1
        is_embd = ".embeddings." in name
        can_quantize = not is_1d and not is_embd
        data_qtype = gguf.GGMLQuantizationType.F32
        if not name.startswith(("vision_tower.vision_model.", "multi_modal_projector.")):
            continue
        for old, new in (
                ("vision_tower.vision_model.encoder.layers.", "v.blk."),
                ("vision_tower.vision_model.", "v."),
                (".embeddings.patch_embedding.", ".patch_embd."),
                (".embeddings.position_embedding.", ".position_embd."),
                ("multi_modal_projector.mm_input_projection_weight", "mm.input_projection.weight"),
                ("multi_modal_projector.mm_soft_emb_norm.weight", "mm.soft_emb_norm.weight"),
                ("post_layernorm.", "post_ln."),
                (".self_attn.k_proj.", ".attn_k."),
                (".self_attn.v_proj.", ".attn_v."),
                (".self_attn.q_proj.", ".attn_q."),
                (".self_attn.out_proj.", ".attn_out."),
                (".layer_norm1.", ".ln1."),
                (".layer_norm2.", ".ln2."),
                (".mlp.fc1.", ".ffn_down."),
                (".mlp.fc2.", ".ffn_up.")):
            name = name.replace(old, new)
        if can_quantize:
            data_qtype = _ftype_qtype(ftype)
        if "soft_emb_norm.weight" in name:
            data_torch = data_torch + 1
        data = data_torch.numpy()
        try:
            data = gguf.quants.quantize(data, data_qtype)
        except Exception:  # "fallback to F16"
            data_qtype = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(data, data_qtype)
        writer.add_tensor(name, data, raw_dtype=data_qtype)
    return _finish(writer, path, None)


def _finish(writer: gguf.GGUFWriter, path: str | Path,
            edit: Callable[[gguf.GGUFWriter], None] | None) -> Path:
    if edit is not None:
        edit(writer)
    path = Path(path)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def drop_key(key: str) -> Callable[[gguf.GGUFWriter], None]:
    """An ``edit`` removing a metadata key."""
    def edit(writer: gguf.GGUFWriter) -> None:
        del writer.kv_data[0][key]
    return edit


def set_key(key: str, value: Any, vtype: gguf.GGUFValueType) -> Callable[[gguf.GGUFWriter], None]:
    """An ``edit`` setting (or replacing) a metadata key."""
    def edit(writer: gguf.GGUFWriter) -> None:
        writer.kv_data[0].pop(key, None)
        writer.add_key_value(key, value, vtype)
    return edit


def stored_types(path: str | Path) -> dict[str, str]:
    """Each tensor's storage type in the file (``F32``, ``F16``, ``Q8_0``, ...)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
