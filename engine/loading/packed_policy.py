"""Which GGUF tensors ``quantization="auto"`` serves packed, and when their float32 copies are
never made.

A tensor is *packable* when it is a decoder linear, the token table or the output head
(:func:`hf_name` maps its GGUF name), 2-D, and stored in a block type the packed kernels serve
(``engine.quantization.gguf_blocks.SUPPORTED``); so is a layer's stack of experts in such
types (a Qwen3-30B-A3B Q4 file: ~120 GB of float32 experts, never written). The float32 copies
of a GGUF's packable tensors are *too big* when they would take more than
:data:`PACKED_ONLY_RAM_FRACTION` of the machine's memory (an 8B Q4_K_M: ~30 GiB as float32,
~5 GB packed): then the one-time conversion does not write them (the loader dequantises them
from the GGUF if ``quantization="none"`` asks for them) and the engine serves them packed
without building a float model or probing it.
"""

from __future__ import annotations

import os

from engine.quantization.gguf_blocks import SUPPORTED

PACKED_ONLY_RAM_FRACTION = 0.5

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name, or None when not a linear."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def is_packable(tensor) -> bool:
    """Whether a ``gguf.GGUFReader`` tensor is served packed (module docstring); a layer's
    stacked experts (``engine.loading.gguf_moe.StackedExperts``) are when every part is a 3-D
    expert tensor of such a block type (``gguf_moe.expert_packs`` packs them per expert)."""
    parts = getattr(tensor, "parts", None)
    if parts is not None:
        return all(len(p.shape) == 3 and int(p.tensor_type) in SUPPORTED for p in parts)
    return (hf_name(tensor.name) is not None and int(tensor.tensor_type) in SUPPORTED
            and len(tensor.shape) == 2)


def total_ram_bytes() -> int:
    """This machine's physical memory (8 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def float_copies_too_big(float_bytes: int, ram_bytes: int | None = None) -> str | None:
    """Why ``float_bytes`` of float32 copies must not be made (module docstring), or None."""
    ram = total_ram_bytes() if ram_bytes is None else ram_bytes
    if float_bytes > PACKED_ONLY_RAM_FRACTION * ram:
        return (f"their float32 copies would take {float_bytes / 2**30:.1f} GiB, more than "
                f"{PACKED_ONLY_RAM_FRACTION:.0%} of this machine's {ram / 2**30:.1f} GiB")
    return None
