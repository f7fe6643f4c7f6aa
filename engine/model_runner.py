"""Owns the model weights, the KV pools and the attention backend on one device.

``execute`` runs one packed step and returns the logits of the rows that are sampled (and of
prompt positions whose logprobs were asked for). The KV pools are allocated once, here, at
start-up: one ``(K, V)`` pair per layer, each ``[num_blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import get_attention_backend
from engine.batch import ModelInput
from engine.config import EngineConfig
from engine.models.arch import ModelArch
from engine.models.registry import build_model

logger = logging.getLogger("kvserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_SHARE = 0.2
_CPU_DEFAULT_KV_CAP = 4 * 1024**3


@dataclass
class ModelOutput:
    sample_logits: torch.Tensor  # [S, V] float32
    prompt_logits: torch.Tensor | None  # [P, V] float32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible")
    return device


def cpu_has_bf16() -> bool:
    """True when the CPU has native bf16 matmul instructions (AVX-512 BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Measured on the development CPU (AVX-512 BF16): bf16 linears run ~2.3x fp32 at batch >= 32.
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def total_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: Any, weights, max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = build_model(hf_config, max_positions=max_model_len)
        self.arch: ModelArch = self.model.arch
        self.model.load_weights(weights)
        self.model.to(device=self.device, dtype=self.dtype)
        self.model.rotary.to(torch.float32)  # tables stay fp32; cast per step
        self.model.eval()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

    # ---- KV pool -------------------------------------------------------------------------

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    @property
    def kv_bytes_per_token(self) -> int:
        return self.arch.kv_bytes_per_token(self.dtype_bytes)

    def kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        return int(min(total_ram_bytes() * _CPU_DEFAULT_KV_SHARE, _CPU_DEFAULT_KV_CAP))

    def _profile_cuda_budget(self) -> int:
        """Free GPU memory under ``gpu_memory_utilization`` after a forward of the largest
        step the scheduler may issue (activations peak), weights included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.config.block_size
        tmp_blocks = -(-n // bs)
        self._allocate(tmp_blocks)
        meta = _profile_metadata(n, tmp_blocks, bs, self.device)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), self.kv_caches, meta,
                                self.backend)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: the model's peak use is "
                             f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB at "
                             f"gpu_memory_utilization={self.config.gpu_memory_utilization}")
        return budget

    def allocate_kv_cache(self) -> int:
        """Size and allocate the pools once; returns the number of blocks."""
        bs = self.config.block_size
        num_blocks = self.kv_budget_bytes() // (self.kv_bytes_per_token * bs)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory is too small for one block of {bs} tokens "
                             f"({self.kv_bytes_per_token * bs} bytes)")
        self._allocate(num_blocks)
        return num_blocks

    def _allocate(self, num_blocks: int) -> None:
        a = self.arch
        shape = (num_blocks, self.config.block_size, a.num_kv_heads, a.head_dim)
        # Zeroed, not empty: padded key slots are masked, but 0 * NaN garbage would still be NaN.
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(a.num_layers)
        ]
        self.num_blocks = num_blocks

    def kv_pool_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.kv_caches)

    # ---- the step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput:
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, self.backend)
        n_sample = inp.sample_indices.numel()
        if inp.prompt_indices.numel():
            rows = torch.cat([inp.sample_indices, inp.prompt_indices])
            logits = self.model.compute_logits(hidden[rows])
            return ModelOutput(logits[:n_sample], logits[n_sample:])
        return ModelOutput(self.model.compute_logits(hidden[inp.sample_indices]), None)


def _profile_metadata(n: int, num_blocks: int, bs: int, device: torch.device):
    from engine.attention import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        block_size=bs, max_query_len=n, max_seq_len=n, num_decodes=0, num_decode_tokens=0,
        query_lens_cpu=[n], seq_lens_cpu=[n])
