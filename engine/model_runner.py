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
from engine.models.layer_ops import layer_ops_for
from engine.models.packed_linear import linear_backend, linear_weight_bytes
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
        self.linear_backend = linear_backend(self.device, self.dtype,
                                             linear_weight_bytes(self.model)) or "torch"
        if self.linear_backend != "torch":
            self.model.pack_linears(self.linear_backend)
        self.model.ops = layer_ops_for(self.device, self.dtype)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the host KV tier
        self.num_host_blocks = 0
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: host-tier copies run here

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

    # ---- host KV tier (swap_space) -------------------------------------------------------

    def allocate_host_kv_cache(self) -> int:
        """Allocate the host pools (same layout as the device pools, pinned on CUDA) sized by
        ``swap_space``; returns the number of host blocks, 0 when the tier is off.

        ``torch.empty``, not zeros: a host block is only ever read after a copy filled it."""
        block_bytes = self.kv_bytes_per_token * self.config.block_size
        n = self.config.swap_space_bytes // block_bytes
        if self.config.swap_space > 0 and n == 0:
            logger.warning("swap_space %.3g GiB holds no block of %d bytes: host tier off",
                           self.config.swap_space, block_bytes)
        if n == 0:
            if self.config.preemption_mode != "recompute":
                logger.warning("preemption_mode=%s needs a host tier (swap_space > 0): "
                               "preempted requests will be recomputed",
                               self.config.preemption_mode)
            return 0
        a = self.arch
        shape = (n, self.config.block_size, a.num_kv_heads, a.head_dim)
        pin = self.device.type == "cuda"
        self.host_kv_caches = [
            (torch.empty(shape, dtype=self.dtype, pin_memory=pin),
             torch.empty(shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(a.num_layers)
        ]
        self.num_host_blocks = n
        self._copy_stream = torch.cuda.Stream(self.device) if pin else None
        logger.info("host KV tier: %d blocks, %.2f GiB%s", n, n * block_bytes / 2**30,
                    " pinned" if pin else "")
        return n

    def copy_kv_blocks(self, d2h: list[tuple[int, int]], h2d: list[tuple[int, int]]) -> None:
        """One step's block moves: ``d2h`` (device block, host block) pairs, then ``h2d``
        (host block, device block) pairs; one batched ``copy_blocks`` call per direction for
        every layer's K and V.

        On CUDA both run on a side stream that first waits for the work already queued (it
        reads KV the last step wrote). The device->host call returns once the data is on the
        host (``copy_blocks`` waits for it), so nothing else waits for it; the compute stream
        waits on an event after the host->device copies only, since this step reads them.
        """
        from kernels.copy_blocks import copy_blocks  # here: the kernels package pulls in triton

        dev = [t for kv in self.kv_caches for t in kv]
        host = [t for kv in self.host_kv_caches for t in kv]
        out = torch.tensor(d2h, dtype=torch.int64).reshape(-1, 2)
        back = torch.tensor(h2d, dtype=torch.int64).reshape(-1, 2)
        if self._copy_stream is None:
            if d2h:
                copy_blocks(dev, host, out)
            if h2d:
                copy_blocks(host, dev, back)
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            if d2h:
                copy_blocks(dev, host, out)
            if h2d:
                copy_blocks(host, dev, back)
                loaded = torch.cuda.Event()
                loaded.record(self._copy_stream)
        if h2d:
            compute.wait_event(loaded)

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
