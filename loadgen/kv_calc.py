"""KV-cache arithmetic: how many bytes the keys and values of one token take, and model shapes.

Bytes per token = 2 (K and V) · layers · kv_heads · head_dim · dtype bytes (int8 rows carry a
2-byte scale each: head_dim + 2). Without GQA every
query head has its own K/V head (kv_heads = heads); with GQA/MQA fewer K/V heads are shared.
The textbook check: LLaMA-7B (32 layers, 32 heads, head_dim 128, fp16) holds 512 KiB per token,
so batch 1 × 1024 tokens = 536,870,912 bytes (512 MiB); with 8 KV heads a quarter of that.

``ModelShape`` (engine/models/arch.py, the one reader of a model's sizes) is also what the FLOPs
yardstick (server/loadgen/yardstick.py) counts with. Shapes come from a local HF model dir or
config.json, a .gguf file's metadata, the embedded model (any name ``engine.loading.embedded``
knows), or a named preset.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.kv_format.formats import int4_row_width
from engine.loading.embedded import EMBEDDED_MODEL_NAME, embedded_gguf_path, is_embedded_name
from engine.models.arch import ModelShape, shape_from_hf_config

__all__ = ["ModelShape", "shape_from_hf_config"]  # re-exported: kv-calc's public names

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
               "bfloat16": 2, "bf16": 2, "fp8": 1, "float8": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int4": 0.5}
INT8_SCALE_BYTES = 2  # an int8 KV row carries its float16 scale (kvserve_kernels/kv_quant_layout.py)

# Public shapes of well-known models (from their config.json files).
PRESETS: dict[str, ModelShape] = {
    s.name: s for s in [
        ModelShape("llama-7b", 32, 32, 32, 128, 4096, 11008, 32000, max_position=2048),
        ModelShape("llama-13b", 40, 40, 40, 128, 5120, 13824, 32000, max_position=2048),
        ModelShape("llama-2-7b", 32, 32, 32, 128, 4096, 11008, 32000, max_position=4096),
        ModelShape("llama-2-13b", 40, 40, 40, 128, 5120, 13824, 32000, max_position=4096),
        ModelShape("llama-2-70b", 80, 64, 8, 128, 8192, 28672, 32000, max_position=4096),
        ModelShape("llama-3-8b", 32, 32, 8, 128, 4096, 14336, 128256, max_position=8192),
        ModelShape("llama-3-70b", 80, 64, 8, 128, 8192, 28672, 128256, max_position=8192),
        ModelShape("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256, max_position=131072),
        ModelShape("llama-3.2-1b", 16, 32, 8, 64, 2048, 8192, 128256, True, max_position=131072),
        ModelShape("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32000, max_position=32768),
        ModelShape("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064, False, True, 32768),
        ModelShape("qwen2.5-0.5b", 24, 14, 2, 64, 896, 4864, 151936, True, True, 32768),
        ModelShape("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, True, max_position=8192),
    ]
}


def dtype_bytes(dtype: str) -> float:
    """Bytes of one K or V element (0.5 for int4), scales not counted."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; use one of float32, float16, bfloat16, "
                         f"fp8, int8, int4")
    return DTYPE_BYTES[key]


def kv_bytes_per_token(shape: ModelShape, dtype: str | int = "float16",
                       kv_heads: int | None = None) -> int:
    """2 · layers · kv_heads · row bytes (``kv_heads`` overrides the model's). A row is
    head_dim · dtype bytes, plus the float16 scale of each row for ``"int8"`` and of each group
    of 32 for ``"int4"`` (the pool's real layout, so this is what a pool of that dtype allocates
    per token)."""
    nbytes = dtype if isinstance(dtype, int) else dtype_bytes(dtype)
    kvh = shape.kv_heads if kv_heads is None else kv_heads
    name = dtype.lower() if isinstance(dtype, str) else ""
    if name == "int4":
        row = int4_row_width(shape.head_dim)
    else:
        row = int(shape.head_dim * nbytes) + (INT8_SCALE_BYTES if name == "int8" else 0)
    return 2 * shape.layers * kvh * row


@dataclass(frozen=True)
class KVReport:
    """KV footprint of ``batch`` sequences of ``seq_len`` tokens, with the model's GQA and
    without it (one K/V head per query head)."""

    shape: ModelShape
    dtype: str
    seq_len: int
    batch: int
    per_token: int
    per_token_per_layer: int
    total: int
    per_layer_total: int
    mha_per_token: int
    mha_total: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch


def kv_report(shape: ModelShape, seq_len: int, batch: int = 1,
              dtype: str = "float16") -> KVReport:
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len and batch must be >= 1; got seq_len={seq_len}, batch={batch}")
    per_tok = kv_bytes_per_token(shape, dtype)
    mha = kv_bytes_per_token(shape, dtype, kv_heads=shape.heads)
    tokens = seq_len * batch
    return KVReport(shape, dtype, seq_len, batch, per_tok, per_tok // shape.layers,
                    per_tok * tokens, per_tok // shape.layers * tokens, mha, mha * tokens)


def human_bytes(n: int | float) -> str:
    """Binary units (KiB = 1024 B), as memory is allocated."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- shape sources


def shape_from_gguf(path: str | os.PathLike[str], name: str | None = None) -> ModelShape:
    """Read the architecture fields of a GGUF file's metadata (no tensor is loaded)."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "llama")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    names = {t.name for t in reader.tensors}
    # GGUF's metadata keys mapped onto config.json's: one reader of the sizes.
    config = {
        "num_hidden_layers": field(f"{arch}.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(f"{arch}.attention.key_length", hidden // heads),
        "hidden_size": hidden, "intermediate_size": field(f"{arch}.feed_forward_length"),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "max_position_embeddings": field(f"{arch}.context_length")}
    return shape_from_hf_config(config, name or Path(path).name).replace(
        qk_norm="blk.0.attn_q_norm.weight" in names)


def resolve_shape(model: str | None) -> ModelShape:
    """A model dir, config.json, .gguf, the embedded model's name (or None), or a preset."""
    if is_embedded_name(model):
        return _embedded_shape()
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return shape_from_hf_config(json.loads((path / "config.json").read_text()), model)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return shape_from_gguf(ggufs[0], model)
        raise ValueError(f"{model}: directory holds neither config.json nor a .gguf file")
    if path.is_file():
        if path.suffix == ".gguf":
            return shape_from_gguf(path)
        return shape_from_hf_config(json.loads(path.read_text()), model)
    key = model.lower().split("/")[-1].removesuffix("-hf").removesuffix("-instruct")
    if key in PRESETS:
        return PRESETS[key]
    raise ValueError(f"unknown model {model!r}: not a local dir/config.json/.gguf nor a preset; "
                     f"presets: {', '.join(PRESETS)} (or give --layers --heads --head-dim)")


def _embedded_shape() -> ModelShape:
    """From the engine's converted copy when it exists (fast), else the GGUF metadata."""
    gguf_path = embedded_gguf_path()
    try:
        from engine.cache_dir import default_cache_dir
        from engine.loading.gguf_convert import converted_dir, is_complete

        converted = converted_dir(gguf_path, default_cache_dir())
        if is_complete(converted):
            cfg = json.loads((converted / "config.json").read_text())
            return shape_from_hf_config(cfg, EMBEDDED_MODEL_NAME)
    except (ImportError, OSError, ValueError):
        pass
    return shape_from_gguf(gguf_path, EMBEDDED_MODEL_NAME)


def shape_from_args(model: str | None, layers: int | None = None, heads: int | None = None,
                    kv_heads: int | None = None, head_dim: int | None = None) -> ModelShape:
    """Resolve ``model`` then apply explicit overrides; a fully explicit shape needs no model."""
    if model is None and layers and heads and head_dim:
        return ModelShape("custom", layers, heads, kv_heads or heads, head_dim)
    shape = resolve_shape(model)
    changes = {k: v for k, v in (("layers", layers), ("heads", heads), ("kv_heads", kv_heads),
                                 ("head_dim", head_dim)) if v is not None}
    if heads is not None and kv_heads is None and shape.kv_heads == shape.heads:
        changes["kv_heads"] = heads  # an MHA model keeps one K/V head per query head
    return shape.replace(**changes) if changes else shape


# ----------------------------------------------------------------------------- CLI


def format_report(r: KVReport) -> str:
    s = r.shape
    gqa = "MHA" if s.kv_heads == s.heads else ("MQA" if s.kv_heads == 1 else "GQA")

    def row(label: str, per_token: int) -> str:
        return (f"{label:24}{human_bytes(per_token):>16}{human_bytes(per_token // s.layers):>18}"
                f"{human_bytes(per_token // s.layers * r.tokens):>18}"
                f"{human_bytes(per_token * r.tokens):>16}")

    lines = [
        f"model {s.name}: {s.layers} layers, {s.heads} heads, {s.kv_heads} KV heads, "
        f"head_dim {s.head_dim}; KV dtype {r.dtype} ({dtype_bytes(r.dtype)} B)",
        f"tokens: batch {r.batch} x seq-len {r.seq_len} = {r.tokens:,}",
        "formula: 2 (K,V) x layers x kv_heads x head_dim x dtype bytes x tokens"
        + (f" (int8: head_dim + {INT8_SCALE_BYTES} scale bytes per row)"
           if r.dtype.lower() == "int8" else "")
        + (" (int4: head_dim / 2 + 2 scale bytes per group of 32)"
           if r.dtype.lower() == "int4" else ""),
        "",
        f"{'':24}{'per token':>16}{'per layer/token':>18}{'per layer (all)':>18}{'total':>16}",
        row(f"{gqa}, {s.kv_heads} KV heads", r.per_token),
    ]
    if s.kv_heads != s.heads:
        lines += [row(f"MHA, {s.heads} KV heads", r.mha_per_token), "",
                  f"total bytes: {r.total:,} ({gqa}) vs {r.mha_total:,} without GQA: "
                  f"{r.mha_total / r.total:.1f}x saved by sharing K/V heads"]
    else:
        lines += ["", f"total bytes: {r.total:,} (no GQA: kv_heads = heads); with GQA the "
                      f"total scales by kv_heads/heads (--kv-heads N)"]
    groups = kv_groups_dict(r)
    if groups is not None:
        kinds = ", ".join(f"{'full' if g['window'] is None else 'window ' + str(g['window'])}: "
                          f"{human_bytes(g['bytes_per_token'])}/token, "
                          f"{human_bytes(g['bytes_held_per_seq'])} held"
                          for g in groups["groups"])
        lines += ["", f"hybrid KV cache: {len(groups['groups'])} groups of "
                      f"{groups['layers_per_group']} layers ({kinds}) per sequence of "
                      f"{r.seq_len}; total {human_bytes(groups['bytes_total'])} = "
                      f"{groups['bytes_total'] / r.total:.3f}x of keeping every layer's history "
                      f"(block size {groups['block_size']})"]
    return "\n".join(lines)


def kv_groups_dict(r: KVReport, block_size: int = 16) -> dict[str, Any] | None:
    """Per KV group of a hybrid model (``engine.kv_cache.groups``): bytes per token and the
    bytes one ``seq_len`` sequence holds (a window group: at most its window + one block),
    and the total for the batch. None for a model with one attention type."""
    from engine.kv_cache.groups import plan_kv_groups

    layout = plan_kv_groups(r.shape.sliding_windows)
    if not layout.is_hybrid:
        return None
    layer = r.per_token_per_layer
    page = layer * layout.group_size * block_size
    groups = [{"layers": list(g.layers), "window": g.window,
               "bytes_per_token": layer * len(g.layers),
               "bytes_held_per_seq": g.max_blocks(r.seq_len, block_size) * page}
              for g in layout.groups]
    return {"layers_per_group": layout.group_size, "block_size": block_size, "groups": groups,
            "bytes_total": sum(g["bytes_held_per_seq"] for g in groups) * r.batch}


def report_dict(r: KVReport) -> dict[str, Any]:
    return {"model": dataclasses.asdict(r.shape), "dtype": r.dtype, "seq_len": r.seq_len,
            "batch": r.batch, "tokens": r.tokens, "bytes_per_token": r.per_token,
            "bytes_per_token_per_layer": r.per_token_per_layer,
            "bytes_per_layer": r.per_layer_total, "bytes_total": r.total,
            "mha_bytes_per_token": r.mha_per_token, "mha_bytes_total": r.mha_total,
            "kv_groups": kv_groups_dict(r)}


def main_from_args(args: Any) -> int:
    """``kvserve kv-calc``: print the report (table or JSON); 2 on a bad model or size."""
    import sys

    if getattr(args, "list_presets", False):
        for shape in PRESETS.values():
            print(f"{shape.name:14} {shape.layers:3} layers {shape.heads:3} heads "
                  f"{shape.kv_heads:3} KV heads head_dim {shape.head_dim}")
        return 0
    try:
        shape = shape_from_args(args.model, args.layers, args.heads, args.kv_heads, args.head_dim)
        seq_len = args.seq_len or shape.max_position or 4096
        report = kv_report(shape, seq_len, args.batch, args.dtype)
    except (ValueError, OSError) as e:
        print(f"kv-calc: {e}", file=sys.stderr)
        return 2
    disk = None
    if getattr(args, "kv_disk_size", None) is not None:
        try:
            from engine.kv_cache.groups import plan_kv_groups

            disk = disk_report(report.per_token, args.kv_disk_size, args.block_size,
                               plan_kv_groups(shape.sliding_windows).num_groups)
        except ValueError as e:
            print(f"kv-calc: {e}", file=sys.stderr)
            return 2
    if args.json:
        out = report_dict(report)
        if disk is not None:
            out["disk_tier"] = disk
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        if disk is not None:
            print(f"\ndisk tier {human_bytes(disk['bytes'])}: {disk['tokens']:,} tokens "
                  f"({disk['blocks']:,} blocks of {disk['block_size']} tokens, "
                  f"{disk['bytes_per_block']:,} bytes each on disk with the record headers)")
    return 0


def disk_report(per_token: int, size: int | str, block_size: int,
                num_groups: int = 1) -> dict[str, int]:
    """How many tokens a disk KV tier of ``size`` holds: whole blocks, each stored with its
    record header (engine/kv_cache/disk/segment.py), segment headers neglected. A hybrid KV
    cache's ``num_groups`` groups store a block of tokens as one record each (one group's
    layers; every group's blocks are written, a window group's too)."""
    from engine.config.kv_disk import parse_size
    from engine.kv_cache.disk.segment import RECORD_HEADER_BYTES

    if block_size < 1:
        raise ValueError(f"block size must be >= 1; got {block_size}")
    n = parse_size(size)
    per_block = per_token * block_size + num_groups * RECORD_HEADER_BYTES
    blocks = n // per_block
    return {"bytes": n, "block_size": block_size, "bytes_per_block": per_block,
            "blocks": blocks, "tokens": blocks * block_size}
