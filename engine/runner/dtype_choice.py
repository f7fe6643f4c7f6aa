"""The engine's compute dtype: ``resolve_dtype`` (``--dtype``, and what ``auto`` means per
device and checkpoint), and whether the CPU has native bf16 at all."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the CPU has native bf16 matmul instructions (AVX-512 BF16 or AMX). Only says
    whether probing bf16 is worth its time (benchmarks); never picks a dtype by itself."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, quantization: str = "auto",
                  hf_config: Any = None, packed_checkpoint: bool = False,
                  cpu_probe: str = "cached") -> torch.dtype:
    """``name`` as a torch dtype. ``auto``: bf16 (fp16 without bf16) on a GPU; on the CPU
    float32 where packed weights serve (int4/int8, or ``auto`` over a quantised GGUF: the
    packed kernels take float32 activations, and their prefill panels' dtype is probed on its
    own), else the faster of float32 and bfloat16 measured on this model's shapes
    (``engine.runner.dtype_probe``, as ``cpu_probe`` says; float32 when no config is given)."""
    if name != "auto":
        return _DTYPES[name]
    if quantization in ("int4", "int8"):
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if packed_checkpoint or hf_config is None:
        return torch.float32
    from engine.runner.dtype_probe import measured_cpu_dtype

    return measured_cpu_dtype(hf_config, cpu_probe)
