"""Which reader an adapter path needs: ``load_adapter`` reads a PEFT directory with
``peft_format`` and a ``.gguf`` file with ``gguf_format`` (the ``--lora-modules`` arguments are
parsed by ``engine.config.lora``)."""

from __future__ import annotations

from pathlib import Path

from engine.lora.adapter import LoRAAdapter
from engine.lora.gguf_format import read_gguf_lora
from engine.lora.peft_format import CONFIG_FILE, read_peft_dir

_EXPECTED = (f"a PEFT adapter directory ({CONFIG_FILE} with adapter_model.safetensors or "
             "adapter_model.bin) or a llama.cpp LoRA adapter file (.gguf)")


def load_adapter(name: str, path: str | Path, *, num_heads: int, num_kv_heads: int,
                 ) -> LoRAAdapter:
    """The adapter at ``path`` served under ``name``: a directory is read as PEFT, a
    ``.gguf`` file as a llama.cpp LoRA GGUF (with the base model's head counts, for the Q/K
    row permutation). ValueError for anything else, saying what was expected."""
    p = Path(path).expanduser()
    if p.is_dir():
        return read_peft_dir(name, p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return read_gguf_lora(name, p, num_heads=num_heads, num_kv_heads=num_kv_heads)
    what = "does not exist" if not p.exists() else "is neither a directory nor a .gguf file"
    raise ValueError(f"LoRA adapter {name!r}: {p} {what}; expected {_EXPECTED}")


