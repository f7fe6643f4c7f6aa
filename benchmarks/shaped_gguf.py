"""What the shaped GGUF writers (``gemma3_gguf.py``, ``qwen3moe_gguf.py``) share: the
embedded model's BPE vocabulary padded to a model's size, and the quantised tensor stream.

The vocabulary is SmolLM2's (the embedded GGUF's BPE tokens, merges and chat template),
padded with ordinary tokens ``<unusedN>`` (no merge makes them; each decodes to its own text,
so a streamed token is never an empty chunk that a client could miss). The benchmarks send
prompts as token ids (``--prompt-token-ids``): transformers' GGUF reader picks its tokeniser
by architecture, llama.cpp by ``tokenizer.ggml.model`` (BPE)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from tqdm import tqdm

NORMAL = 1  # llama.cpp's token type of an ordinary token


def add_padded_vocab(w, vocab: int) -> None:
    """Write the embedded model's tokenizer fields into GGUF writer ``w``, the token list
    padded to ``vocab`` entries."""
    import gguf

    from engine.loading.embedded import embedded_gguf_path
    from engine.loading.gguf_fields import gguf_field

    src = gguf.GGUFReader(embedded_gguf_path())
    tokens = list(gguf_field(src, "tokenizer.ggml.tokens"))
    types = list(gguf_field(src, "tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    w.add_tokenizer_model(gguf_field(src, "tokenizer.ggml.model"))
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_token_types(types + [NORMAL] * pad)
    w.add_tokenizer_pre(gguf_field(src, "tokenizer.ggml.pre"))
    w.add_token_merges(list(gguf_field(src, "tokenizer.ggml.merges")))
    w.add_bos_token_id(gguf_field(src, "tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(gguf_field(src, "tokenizer.ggml.eos_token_id"))
    w.add_unk_token_id(gguf_field(src, "tokenizer.ggml.unknown_token_id"))
    w.add_pad_token_id(gguf_field(src, "tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(gguf_field(src, "tokenizer.chat_template"))


def write_tensors(w, tensors: Iterable[tuple[str, np.ndarray]], count: int,
                  qtype_of: Callable[[str], object], desc: str) -> None:
    """Add every ``(name, array)``: 1-D ones as float32, the others quantised to
    ``qtype_of(name)``; then write the file and close ``w``."""
    import gguf

    for name, t in tqdm(tensors, total=count, desc=desc, unit="tensor"):
        t = t.astype(np.float32)
        if t.ndim == 1:
            w.add_tensor(name, t)
            continue
        qtype = qtype_of(name)
        w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
