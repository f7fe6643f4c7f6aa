"""Quantised KV storage: how a K or V row of one token and one KV head is kept in the pool.

``kv_cache_dtype`` (vLLM's names) picks the format: ``auto`` (``float16`` on a CPU under an
automatically chosen float32 model, else the model's dtype: :func:`resolve_kv_cache_dtype`),
``float32``, ``float16`` / ``bfloat16``, ``int8``, ``int4``, ``fp8_e4m3`` / ``fp8_e5m2``. The
row layout of each, scales included, is spelled out on :class:`KVFormat`; every scale travels
inside its row (int8, int4) or on the attention layer (fp8), so block moves need no extra
bookkeeping.

Contracts: :func:`quantize_rows` maps ``[..., KVH, D]`` float rows to pool rows
``[..., KVH, row_width]`` of ``storage_dtype``; :func:`dequantize_rows` is its inverse up to the
format's rounding, returning ``dtype``. Both are pure and work on any device. Which format a
pool holds is read back from the pool itself (:func:`format_of`), so attention backends need no
configuration to read it. Figures behind the defaults: docs/performance.md#int4-kv-cache and
docs/decisions.md#quality-figures-behind-defaults."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.config.engine import KV_CACHE_DTYPES

INT8_SCALE_BYTES = 2  # one float16 scale per row (kvserve_kernels/kv_quant_layout.py: the same)

INT8_SCALE_FLOOR = 2.0 ** -14  # smallest normal float16

INT4_GROUP = 32  # elements per int4 scale (kvserve_kernels/kv_quant_layout.py: the same)

_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_FLOAT16 = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def fp8_dtype(name: str) -> torch.dtype:
    """The torch dtype of an fp8 ``kv_cache_dtype``; ``ValueError`` when this torch has none."""
    dt = getattr(torch, _FP8[name], None)
    if dt is None:
        raise ValueError(f"kv_cache_dtype {name!r} needs torch.{_FP8[name]} (torch >= 2.1)")
    return dt


# Bump a kind's version whenever its bytes change meaning (element order, scale placement,
# rotation, rounding): the disk tier keys its files by it (engine.kv_cache.disk.fingerprint).
ROW_LAYOUT_VERSIONS = {"float": 1, "int8": 1, "fp8": 1, "int4": 1}


@dataclass(frozen=True)
class KVFormat:
    """The storage of one pool: ``kind`` is "float", "int8", "int4" or "fp8".

    * float (``float32``, ``float16``, ``bfloat16``): rows of ``head_dim`` elements, rounded to
      nearest even; under a float32 model the CPU decode kernel widens 16-bit rows in registers
      and the rest of the model's math stays float32. ``float32`` needs a float32 model (the
      exact path the HF-parity tests pin).
    * int8: symmetric, one float16 scale per token per KV head stored INSIDE the row: ``head_dim
      + 2`` int8 bytes, the last two the scale's bits (values rounded half away from zero, as
      the Triton ``store_kv`` does). ``x ~= scale * q``, ``q`` in [-127, 127], ``scale =
      max(absmax / 127, 2**-14)`` (the floor keeps the scale a normal float16; a row that small
      quantises with an absolute error under 2**-15).
    * int4: 4-bit values in groups of :func:`int4_group` elements of each token's KV head, packed
      two to a byte as llama.cpp's ``q4_0`` (byte ``i`` of a group holds element ``i`` in its
      low nibble and element ``i + group/2`` in its high one), then one float16 scale per group,
      all inside the row: ``head_dim / 2 + 2 * groups`` uint8 bytes. Symmetric: ``q =
      clamp(round(y / scale) + 8, 0, 15)``, the group's largest-magnitude value mapping to ``q =
      0`` exactly (``scale = -m / 8``). The values quantised are ``y = x @ R``, ``R`` the
      orthonormal Walsh-Hadamard matrix of each group (:func:`int4_rotate`; the identity for a
      group whose size is not a power of two), which spreads a channel's outlier over the group
      (QuaRot's idea). ``R`` is symmetric and its own inverse and attention is unchanged by it
      (``q.k = (qR).(kR)``, ``sum w (vR) = (sum w v) R``), so the compiled kernels read the rows
      as plain ``q4_0`` with a rotated query and rotate their output back (the backends do
      both). :func:`dequantize_rows` returns ``x`` (rotated back); :func:`dequantize_int4_plain`
      the ``y`` the kernels see.
    * fp8 (``fp8_e4m3`` / ``fp8_e5m2``): one float8 byte per element and a per-layer,
      per-KV-head float32 scale held by the attention layer (1.0 unless
      ``calculate_kv_scales`` calibrated it): ``x ~= scale * float(q)``, values saturate at the
      format's largest finite number.
    """

    kind: str
    storage_dtype: torch.dtype
    head_dim: int

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per (token, KV head) row."""
        if self.kind == "int8":
            return self.head_dim + INT8_SCALE_BYTES
        if self.kind == "int4":
            return int4_row_width(self.head_dim)
        return self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.storage_dtype.itemsize

    @property
    def layout(self) -> str:
        """The row layout's name and version (``ROW_LAYOUT_VERSIONS``): what the disk tier's
        fingerprint records, so that bytes written under another layout are never read."""
        return f"{self.kind}-v{ROW_LAYOUT_VERSIONS[self.kind]}"

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.storage_dtype).max)


def int4_group(head_dim: int) -> int:
    """Elements per int4 scale: 32, or the whole row when ``head_dim`` is not a multiple of 32."""
    if head_dim % 2:
        raise ValueError(f"an int4 KV pool needs an even head_dim; got {head_dim}")
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def int4_row_width(head_dim: int) -> int:
    """Bytes of an int4 row: the packed values, then one float16 scale per group."""
    return head_dim // 2 + 2 * (head_dim // int4_group(head_dim))


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device_type: str,
                           dtype_setting: str = "auto") -> tuple[str, str]:
    """``(the pool's kv_cache_dtype, why)``: ``auto`` becomes ``float16`` on a CPU under a
    float32 model when ``dtype_setting`` (the engine's ``dtype``) is ``auto``, and the model's
    own dtype otherwise (an explicit ``dtype float32`` is float32 throughout); any other name
    stays. Pure."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype, "as requested"
    if device_type == "cpu" and model_dtype == torch.float32 and dtype_setting == "auto":
        return "float16", ("auto on CPU: 16-bit like llama.cpp's default cache, half the "
                           "bytes of float32; --kv-cache-dtype float32 keeps the exact pool")
    name = str(model_dtype).removeprefix("torch.")
    return name, f"auto: the model's dtype ({name})"


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The pool format for ``kv_cache_dtype`` (see :class:`KVFormat`; ``auto`` here is the
    model's dtype: resolve it first with :func:`resolve_kv_cache_dtype`)."""
    if kv_cache_dtype in ("auto", str(model_dtype).removeprefix("torch.")):
        return KVFormat("float", model_dtype, head_dim)
    if kv_cache_dtype == "float32":
        raise ValueError(f"kv_cache_dtype float32 needs a float32 model; this one runs "
                         f"{str(model_dtype).removeprefix('torch.')} (use auto or float16)")
    if kv_cache_dtype in _FLOAT16:
        return KVFormat("float", _FLOAT16[kv_cache_dtype], head_dim)
    if kv_cache_dtype == "int8":
        return KVFormat("int8", torch.int8, head_dim)
    if kv_cache_dtype == "int4":
        int4_group(head_dim)  # validates head_dim
        return KVFormat("int4", torch.uint8, head_dim)
    if kv_cache_dtype in _FP8:
        return KVFormat("fp8", fp8_dtype(kv_cache_dtype), head_dim)
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                     f"got {kv_cache_dtype!r}")


def format_of(cache: torch.Tensor, head_dim: int) -> KVFormat:
    """The format a pool tensor ``[..., KVH, row_width]`` holds, read from its dtype/width."""
    if cache.dtype == torch.int8:
        if cache.shape[-1] != head_dim + INT8_SCALE_BYTES:
            raise ValueError(f"an int8 KV pool has rows of head_dim + {INT8_SCALE_BYTES}; got "
                             f"{cache.shape[-1]} for head_dim {head_dim}")
        return KVFormat("int8", torch.int8, head_dim)
    if cache.dtype == torch.uint8:
        if cache.shape[-1] != int4_row_width(head_dim):
            raise ValueError(f"an int4 KV pool has rows of {int4_row_width(head_dim)} bytes for "
                             f"head_dim {head_dim}; got {cache.shape[-1]}")
        return KVFormat("int4", torch.uint8, head_dim)
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        return KVFormat("fp8", cache.dtype, head_dim)
    return KVFormat("float", cache.dtype, head_dim)


def quantize_rows(x: torch.Tensor, fmt: KVFormat,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., KVH, D]`` -> pool rows ``[..., KVH, row_width]`` of ``fmt.storage_dtype``.

    ``scale``: fp8: ``[KVH]`` float32, the per-head scale; int4: ``[KVH, D]`` float32, the
    calibrated per-channel smoothing of keys (``x / scale`` is what is rotated and stored;
    engine/kv_format/calibration.py); None: 1.0."""
    if fmt.kind == "float":
        return x.to(fmt.storage_dtype)
    xf = x.float()
    if fmt.kind == "int8":
        s = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(min=INT8_SCALE_FLOOR)
        s16 = s.to(torch.float16)
        y = xf / s16.float()
        q = (y.abs() + 0.5).floor_().mul_(y.sign()).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q, s16.view(torch.int8)], dim=-1)
    if fmt.kind == "int4":
        if scale is not None:
            xf = xf / scale.float()
        return _quantize_int4(int4_rotate(xf), fmt.head_dim)
    if scale is not None:
        xf = xf / scale.float().unsqueeze(-1)
    return xf.clamp_(-fmt.fp8_max, fmt.fp8_max).to(fmt.storage_dtype)


def dequantize_rows(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pool rows ``[..., KVH, row_width]`` -> ``[..., KVH, D]`` of ``dtype`` (see
    :func:`quantize_rows`; ``scale`` is the fp8 per-head scale or the int4 per-channel one,
    None meaning 1.0)."""
    if fmt.kind == "float":
        return rows.to(dtype)
    d = fmt.head_dim
    if fmt.kind == "int8":
        s = row_scales(rows, fmt)
        return (rows[..., :d].to(torch.float32) * s.unsqueeze(-1)).to(dtype)
    if fmt.kind == "int4":
        out = int4_rotate(dequantize_int4_plain(rows, d))
        return (out if scale is None else out * scale.float()).to(dtype)
    out = rows.to(torch.float32)
    if scale is not None:
        out = out * scale.float().unsqueeze(-1)
    return out.to(dtype)


def byte_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` itself, or for fp8 its uint8 view: CPU PyTorch does not index or
    ``index_copy_`` float8 tensors, and moving bytes is exactly what those do."""
    if pool.dtype.itemsize == 1 and pool.dtype.is_floating_point:
        return pool.view(torch.uint8)
    return pool


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``pool[blocks]`` for any pool dtype (fp8 through its byte view)."""
    return byte_view(pool)[blocks].view(pool.dtype)


@functools.lru_cache(maxsize=4)
def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of an fp8 ``dtype`` (the CPU decode kernel
    reads fp8 pools through it)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).contiguous()


def row_scales(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The float32 scales ``[..., KVH]`` of int8 pool rows."""
    d = fmt.head_dim
    tail = rows[..., d:d + INT8_SCALE_BYTES]
    return tail.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def int4_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ R`` over the last dimension (:class:`KVFormat`): each int4 group of ``x``'s
    elements times the group's orthonormal Walsh-Hadamard matrix (symmetric, its own inverse,
    so this also rotates back); ``x`` itself when the group size is not a power of two.

    Computed as the fast Walsh-Hadamard transform in float32: stages ``h = 1, 2, 4, ...``
    each replace the pairs ``(a, b)`` of elements ``h`` apart (in blocks of ``2h``) by
    ``(a + b, a - b)``, then one multiplication by ``1/sqrt(group)``. The compiled kernels
    (C++ and Triton) do exactly these operations in this order, so their rotations are
    bit-identical to this one."""
    d = x.shape[-1]
    g = int4_group(d)
    if g & (g - 1):
        return x
    dtype = x.dtype
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < g:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return (y.reshape(*lead, d) * INT4_ROTATION_NORM[g]).to(dtype)


# 1/sqrt(g) as float32 for each power-of-two group size the format can have.
INT4_ROTATION_NORM = {1 << i: float(torch.tensor(1.0 / (1 << i) ** 0.5, dtype=torch.float32))
                      for i in range(1, 12)}


def _quantize_int4(xf: torch.Tensor, d: int) -> torch.Tensor:
    """float32 ``y [..., D]`` (already rotated) -> int4 rows ``[..., D/2 + 2*groups]`` uint8
    (:class:`KVFormat`)."""
    g = int4_group(d)
    grouped = xf.reshape(*xf.shape[:-1], d // g, g)
    idx = grouped.abs().argmax(dim=-1, keepdim=True)
    scale = (grouped.gather(-1, idx) / -8.0).to(torch.float16)  # [..., G, 1]
    sf = scale.float()
    inv = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / sf)
    y = grouped * inv + 8.0
    q = (y + 0.5).floor_().clamp_(0, 15).to(torch.uint8)  # y >= -0.5 after the shift
    packed = q[..., : g // 2] | (q[..., g // 2:] << 4)  # [..., G, g/2]
    packed = packed.reshape(*xf.shape[:-1], d // 2)
    return torch.cat([packed, scale.squeeze(-1).contiguous().view(torch.uint8)], dim=-1)


def dequantize_int4_plain(rows: torch.Tensor, d: int) -> torch.Tensor:
    """int4 rows -> the float32 ``y = x @ R`` ``[..., D]`` they hold (:class:`KVFormat`): what
    the compiled kernels read, before the rotation back."""
    g = int4_group(d)
    groups = d // g
    packed = rows[..., : d // 2].reshape(*rows.shape[:-1], groups, g // 2)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).to(torch.float32) - 8.0
    scale = rows[..., d // 2: d // 2 + 2 * groups].contiguous().view(torch.float16).float()
    return (q * scale.unsqueeze(-1)).reshape(*rows.shape[:-1], d)
