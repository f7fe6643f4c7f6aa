"""What gives a KV block's bytes their meaning. Blocks are stored under (fingerprint, chained
block hash); a directory's blocks written under another fingerprint are never read (they live
in another sub-directory, and every segment header repeats the fingerprint).

Covered: the weights' identity (resolved path, and name, size and mtime of every file of the
model), load format and seed (dummy weights), dtype, KV dtype and pool layout (block size,
layers, KV heads, row width), the KV row layout's version (int4's group order and rotation,
for one: ``engine.kv_format.formats.ROW_LAYOUT_VERSIONS``), the model config (RoPE settings,
head layout, windows), the quantisation mode and linear backend (they change the computed
values), KV scale calibration, tensor-parallel rank and size, and this format's version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT_VERSION = 1


@dataclass(frozen=True)
class KVFingerprint:
    weights: str  # digest of the model files' names, sizes and mtimes (and the path)
    model_config: str  # digest of the model config (RoPE, layers, heads, windows, ...)
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    row_bytes: int
    quantization: str
    kv_layout: str = ""  # the row layout and its version (KVFormat.layout)
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> bytes:
        """32 bytes naming everything above (SHA-256 of its canonical JSON)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()[:24]


_NOT_WEIGHTS = {"kvserve-last-use"}


def weights_identity(model_path: Path, extra: str = "") -> str:
    """A digest of the model's resolved path and its files' names, sizes and mtimes (a file
    given directly counts as itself). ``extra``: load format, seed, anything else."""
    path = Path(model_path).resolve()
    h = hashlib.sha256(f"{path}|{extra}".encode())
    # bookkeeping a model directory gets touched with at every start (the conversion cache's
    # LRU marker) is not the weights: counted, it made every process's fingerprint differ
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and p.name not in _NOT_WEIGHTS
        and not p.name.startswith("."))
    for p in files[:256]:
        st = p.stat()
        h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def config_digest(config: object) -> str:
    """A digest of a model config (``to_dict()`` when it has one)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
