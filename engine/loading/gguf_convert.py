"""One-time conversion of a GGUF checkpoint into a local Hugging Face model directory.

The engine reads Hugging Face layouts only; a GGUF is turned into one, once, with transformers'
own GGUF pieces (config and tokenizer readers, dequantiser, the processors that undo llama.cpp's
Q/K row permutation, its name map), kept in a cache directory. Tensors are dequantised and
written one shard at a time, so the float32 model is never held in memory; packed tensors whose
float32 copies would be too big (``engine.loading.packed_policy``) are not written at all: the
marker names them (``in_gguf``) and :func:`iter_gguf_tensors` dequantises them on demand.

Contract of :func:`ensure_converted`: the target directory either does not exist or is complete
(written into a temporary sibling, renamed into place, :data:`MARKER` written last); two
processes converting the same file: an advisory lock makes the second wait and reuse the
result (without ``fcntl`` the atomic rename lets one win); weights are written in float32, and
tied embeddings once, under the input embedding's name (no ``lm_head.weight``, as in HF's own
checkpoints)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine.loading import gguf_moe
from engine.loading.gguf_fields import gguf_reader

logger = logging.getLogger("kvserve.loader")

# Bump when the layout written below changes: it is part of the cache key, so old caches are
# simply not found any more (and can be deleted by hand) instead of being misread.
# 3: generation_config.json carries the file's general.sampling.*; 4: keyed by content
# (cache_key), the marker names the key (kvserve cache prune drops older formats).
CONVERSION_FORMAT = 4
MARKER = "kvserve-conversion.json"
LAST_USE = "kvserve-last-use"  # touched at every use of a conversion (kvserve cache ls|prune)
GGUF_MAGIC = b"GGUF"
# Shard size for the written safetensors: small models get one file, big ones a few shards.
MAX_SHARD_BYTES = 4 * 1024**3
_CHAT_PROBE = [{"role": "user", "content": "ping"}]
# ``general.architecture`` values of the GGUF files kvserve runs (Mistral files say "llama").
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3",
                               "qwen3moe")


def is_gguf_file(path: Path) -> bool:
    """True when ``path`` is a readable file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def cache_key(gguf_path: Path) -> str:
    """A short key of the file's content and of the converter's version
    (:data:`CONVERSION_FORMAT`): its size, its first :data:`_HEAD_BYTES` (the header, the
    metadata and the tensor table, where every tensor's name, type, shape and offset is) and
    :data:`_SAMPLES` slices spread over the rest. Not its path nor its mtime: the same file in
    two venvs, copied or touched, is one cache entry; any change to its metadata, its tensor
    table or its size is another. Reads at most ~4 MiB, whatever the file's size."""
    h = hashlib.sha256(f"kvserve-gguf\0{CONVERSION_FORMAT}\0".encode())
    with open(gguf_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"{size}\0".encode())
        h.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            step = (size - _HEAD_BYTES) / _SAMPLES
            for i in range(_SAMPLES):
                f.seek(_HEAD_BYTES + int(i * step))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


# What cache_key reads: the head (a GGUF's metadata and tensor table; a 32k-token vocabulary is
# well under 2 MiB of it) and slices of the tensor data.
_HEAD_BYTES = 2 * 1024**2
_SAMPLES = 64
_SAMPLE_BYTES = 32 * 1024


def converted_dir(gguf_path: Path, cache_root: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives: ``<cache_root>/models/<stem>-<key>`` (the
    key: :func:`cache_key`, of the content); a complete conversion of the same content under
    another file name (``<other stem>-<key>``) is that one."""
    key = cache_key(gguf_path)
    models = cache_root / "models"
    own = models / f"{gguf_path.stem}-{key}"
    if not is_complete(own) and models.is_dir():
        for other in sorted(models.glob(f"*-{key}")):
            if not other.name.startswith(".") and is_complete(other):
                return other
    return own


def note_use(directory: Path, gguf_path: Path | None = None) -> None:
    """Record a use of a converted directory (:data:`LAST_USE`'s mtime: what ``kvserve cache
    ls`` shows and ``prune --older-than`` reads) and, when the file its marker names is gone
    (the same content, reached by another path), name ``gguf_path`` instead: a conversion that
    left tensors in the GGUF reads them from there. A read-only cache is left as it is."""
    try:
        (directory / LAST_USE).touch()
        if gguf_path is not None:
            marker = directory / MARKER
            info = json.loads(marker.read_text())
            if not is_gguf_file(Path(info.get("source", ""))):
                info["source"] = str(Path(gguf_path).resolve())
                marker.write_text(json.dumps(info, indent=2))
    except (OSError, ValueError):
        pass


def is_complete(directory: Path) -> bool:
    """A converted directory counts only once its marker (written last) is there."""
    return (directory / MARKER).is_file()


def gguf_architecture(gguf_path: Path) -> str:
    """The file's ``general.architecture`` (read from its header only)."""

    field = gguf_reader(gguf_path).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{gguf_path} has no general.architecture in its metadata; is it a "
                         "model GGUF?")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_supported(gguf_path: Path) -> str:
    """The file's architecture, or ValueError naming the supported ones: run before any
    conversion work, so an unsupported model is refused in well under a second."""
    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"cannot convert {gguf_path}: unsupported GGUF architecture {arch!r}; kvserve "
                         f"runs GGUF files of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (and "
                         "Hugging Face directories of the same models)")
    return arch


def ensure_converted(gguf_path: Path, target: Path, *, progress: bool | None = None) -> Path:
    """Return ``target``, converting ``gguf_path`` into it first unless a complete copy exists.

    Safe against interruption and against concurrent callers (see the module docstring).
    An architecture kvserve does not run is refused first (:func:`check_supported`).
    """
    if is_complete(target):
        logger.debug("using cached conversion %s", target)
        note_use(target, gguf_path)
        return target
    check_supported(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{target.name}.lock") as locked:
        if is_complete(target):
            logger.info("another process converted %s meanwhile; reusing it", gguf_path.name)
            return target
        if locked:  # only under the lock is every temp dir known to be dead
            _remove_stale_temps(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            start = time.perf_counter()
            logger.info("converting %s into %s (one time only)", gguf_path, target)
            convert_gguf(gguf_path, tmp, progress=progress)
            _make_readable(tmp)
            _publish(tmp, target)
            note_use(target)
            logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool | None = None,
                 weights_in_gguf: bool = False) -> None:
    """Write a Hugging Face directory for ``gguf_path`` into the existing directory ``out_dir``.
    ``weights_in_gguf``: write no weights at all (an empty safetensors file; every tensor is
    named in the marker and read from the GGUF at load), for when no cache can hold them.

    Not atomic by itself (use :func:`ensure_converted`). Raises ``ValueError`` when transformers
    cannot read the file (e.g. an architecture or tokenizer its GGUF reader does not know) and
    ``RuntimeError`` when the written directory does not load back with a working chat template.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_path = gguf_path.resolve()
    check_supported(gguf_path)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    # progress=None lets tqdm decide (off when stderr is not a terminal).
    disable = None if progress is None else not progress
    log = _StageLog(name, disable)
    with tqdm(total=5, desc=f"Converting {name}", unit="stage", disable=disable) as stages:
        log("tokenizer")
        stages.set_postfix_str("tokenizer")
        with _unreadable_as_value_error(gguf_path):
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name,
                                                      local_files_only=True)
        if not tokenizer.chat_template:
            tokenizer.chat_template = _gguf_chat_template(gguf_path)
        stages.update()

        log("config")
        stages.set_postfix_str("config")
        with _unreadable_as_value_error(gguf_path):
            config = AutoConfig.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
            config = gguf_moe.moe_config(gguf_path, config)  # experts: see gguf_moe
        _apply_gguf_overrides(gguf_path, config)
        stages.update()

        log("dequantise and write weights")
        stages.set_postfix_str("dequantise and write weights")
        with _unreadable_as_value_error(gguf_path):
            model_class, in_gguf = _write_weights_streaming(gguf_path, config, out_dir,
                                                            disable=disable,
                                                            all_in_gguf=weights_in_gguf,
                                                            log=log)
        stages.update()

        log("save config and tokenizer")
        stages.set_postfix_str("save config")
        # The GGUF quantisation note would make transformers treat the fp32 directory as GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [model_class]
        config.dtype = torch.float32
        config.save_pretrained(out_dir)
        generation = GenerationConfig.from_model_config(config)
        for key, value in _gguf_sampling(gguf_path).items():  # llama.cpp's sampling defaults
            setattr(generation, key, value)
        generation.save_pretrained(out_dir)
        limit = getattr(config, "max_position_embeddings", None)
        if limit and tokenizer.model_max_length > limit:  # GGUF gives no limit: a 1e30 sentinel
            tokenizer.model_max_length = limit
        tokenizer.save_pretrained(out_dir)
        stages.update()

        log("verify")
        stages.set_postfix_str("verify")
        _verify(out_dir)
        _write_marker(out_dir, gguf_path, config.model_type, in_gguf)
        stages.update()


class _StageLog:
    """Conversion progress as log lines where no progress bar is drawn (stderr not a
    terminal, or ``progress=False``): each stage with the time so far, and the weights at
    every quarter with an estimate of the time left."""

    def __init__(self, name: str, disable: bool | None) -> None:
        import sys

        self.name = name
        self.on = disable is True or (disable is None and not sys.stderr.isatty())
        self.start = time.perf_counter()
        self._weights_start = self.start
        self._quarter = 0

    def __call__(self, stage: str) -> None:
        if stage.startswith("dequantise"):
            self._weights_start = time.perf_counter()
        if self.on:
            logger.info("converting %s: %s (%.1f s so far)", self.name, stage,
                        time.perf_counter() - self.start)

    def tensors(self, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if not self.on or quarter <= self._quarter or done >= total:
            return
        self._quarter = quarter
        spent = time.perf_counter() - self._weights_start
        logger.info("converting %s: weights %d%% (%d/%d tensors, about %.0f s left)", self.name,
                    100 * done // total, done, total, spent * (total - done) / max(done, 1))


def _apply_gguf_overrides(gguf_path: Path, config) -> None:
    """Set what the file means but transformers' reader drops (Gemma: ``gguf_gemma``)."""

    from engine.loading.gguf_gemma import gemma_overrides

    reader = gguf_reader(gguf_path)
    for key, value in gemma_overrides(reader, gguf_architecture(gguf_path)).items():
        setattr(config, key, value)


@contextlib.contextmanager
def _unreadable_as_value_error(gguf_path: Path) -> Iterator[None]:
    try:
        yield
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(
            f"cannot convert {gguf_path}: transformers' GGUF reader failed ({exc}). Pass a GGUF of an "
            "architecture transformers can read (llama, mistral, qwen2, qwen3, ...) or a Hugging "
            "Face directory"
        ) from exc


class _GGUFTensors:
    """A GGUF's tensors under HF names, each dequantised to float32 on demand exactly as
    transformers' ``from_pretrained`` would hold it (its dequantiser, tensor processor and name
    map; a tied output projection is left out)."""

    def __init__(self, gguf_path: Path, config) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        self.parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        reader = gguf_reader(gguf_path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
            config=self.parsed.get("config", {}))
        if not torch.cuda.is_available():
            # A CPU host: the meta-device skeleton would import torch._dynamo and, through it,
            # Triton (and its exit noise), which a CPU server never uses (triton_import.py).
            from engine.triton_import import import_torch_dynamo_without_triton

            import_torch_dynamo_without_triton()
        with torch.device("meta"):  # names and shapes only: no weights are allocated
            skeleton = AutoModelForCausalLM.from_config(config)
        self.model_class = type(skeleton).__name__
        self.names = get_gguf_hf_weights_map(skeleton, self.processor,
                                             gguf_moe.gguf_model_type(config))
        self.expected = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.expected.pop("lm_head.weight", None)
        self.plan = [(t, self.names[t.name]) for t in reader.tensors
                     if self.names.get(t.name) in self.expected]
        self.plan = gguf_moe.expert_plan(reader, self.plan, self.expected)

    def float32(self, tensor, hf: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        if isinstance(tensor, gguf_moe.StackedExperts):
            t = tensor.float32()
        else:
            result = self.processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                            name=tensor.name, tensor_key_mapping=self.names,
                                            parsed_parameters=self.parsed)
            t = torch.from_numpy(np.copy(result.weights)).to(torch.float32).contiguous()
        if tuple(t.shape) != self.expected[hf]:
            raise ValueError(f"GGUF tensor {tensor.name} has shape {tuple(t.shape)}; "
                             f"{hf} needs {self.expected[hf]}")
        return t


def _write_weights_streaming(gguf_path: Path, config, out_dir: Path, *, disable: bool | None,
                             all_in_gguf: bool = False,
                             log: _StageLog | None = None) -> tuple[str, list[str]]:
    """Save the GGUF's tensors (:class:`_GGUFTensors`) as float32 safetensors, dequantised one
    at a time and written a shard at a time (sharded above MAX_SHARD_BYTES): memory holds one
    shard, never the whole model. The packable tensors
    (``engine.loading.packed_policy``) are left out when their float32 copies would be too big
    for this machine: the engine serves them packed, and reads them from the GGUF only if asked
    for float. Returns the HF model class name and the names left in the GGUF (every tensor
    with ``all_in_gguf``: then only an empty safetensors file is written)."""
    from safetensors.torch import save_file

    from engine.loading.packed_policy import float_copies_too_big, is_packable

    src = _GGUFTensors(gguf_path, config)
    if all_in_gguf:
        save_file({}, out_dir / "model.safetensors", metadata={"format": "pt"})
        return src.model_class, sorted(hf for _, hf in src.plan)
    packable = [(t, hf) for t, hf in src.plan if is_packable(t)]
    too_big = float_copies_too_big(sum(4 * int(t.n_elements) for t, _ in packable))
    in_gguf = sorted(hf for _, hf in packable) if too_big else []
    left_out = set(in_gguf)
    if too_big:
        logger.info("%s: packed tensors stay in the GGUF, not converted (%s)", gguf_path.name,
                    too_big)
    plan = [(t, hf) for t, hf in src.plan if hf not in left_out]
    shards: list[list[tuple]] = [[]]
    size = 0
    for tensor, hf in plan:
        nbytes = int(tensor.n_elements) * 4
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((tensor, hf))
        size += nbytes
    weight_map, total, done = {}, 0, 0
    bar = tqdm(total=len(plan), desc="tensors", unit="tensor", leave=False, disable=disable)
    for i, shard in enumerate(shards, start=1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for tensor, hf in shard:
            tensors[hf] = src.float32(tensor, hf)
            weight_map[hf] = file
            total += tensors[hf].numel() * 4
            bar.update()
            done += 1  # not bar.n: a disabled bar does not count
            if log is not None:
                log.tensors(done, len(plan))
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        del tensors
    bar.close()
    missing = [n for n in src.expected if n not in weight_map and n not in left_out]
    if missing:
        raise ValueError(f"the GGUF lacks tensors for {', '.join(missing[:5])}"
                         + (" …" if len(missing) > 5 else ""))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return src.model_class, in_gguf


def in_gguf_names(model_dir: Path) -> list[str]:
    """The tensors a converted directory left in its GGUF (none for a full conversion)."""
    try:
        return list(json.loads((Path(model_dir) / MARKER).read_text()).get("in_gguf", []))
    except (OSError, ValueError):
        return []


def iter_gguf_tensors(model_dir: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, float32 tensor)`` for ``names`` left in the GGUF of a converted directory,
    dequantised one at a time exactly as a full conversion would have written them."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not names:
        return
    source = Path(json.loads((model_dir / MARKER).read_text())["source"])
    if not is_gguf_file(source):
        raise ValueError(f"{model_dir} keeps tensors in {source}, which is no longer readable")
    src = _GGUFTensors(source, AutoConfig.from_pretrained(model_dir, local_files_only=True))
    wanted = set(names)
    for tensor, hf in src.plan:
        if hf in wanted:
            yield hf, src.float32(tensor, hf)


def _gguf_sampling(gguf_path: Path) -> dict[str, float]:

    from engine.loading.generation_defaults import gguf_sampling

    return gguf_sampling(gguf_reader(gguf_path))


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The chat template from the GGUF metadata, for when transformers' tokenizer drops it."""

    field = gguf_reader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        logger.info("%s carries no chat template: a built-in one is chosen when it loads "
                    "(engine/loading/builtin_templates.py; --chat-template overrides)",
                    gguf_path.name)
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _verify(out_dir: Path) -> None:
    """Load the written directory back the way the engine will, and try the chat template."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(out_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if tokenizer.chat_template:
        try:
            tokenizer.apply_chat_template(_CHAT_PROBE, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a broken template must not be cached
            raise RuntimeError(f"the converted chat template does not render: {exc}") from exc


def _write_marker(out_dir: Path, gguf_path: Path, model_type: str,
                  in_gguf: list[str] | None = None) -> None:
    st = gguf_path.stat()
    info = {
        "format": CONVERSION_FORMAT,
        "key": cache_key(gguf_path),
        "source": str(gguf_path),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "model_type": model_type,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "in_gguf": in_gguf or [],  # tensors not converted: read from the source when needed
    }
    (out_dir / MARKER).write_text(json.dumps(info, indent=2))


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``; if another process got there first, keep theirs."""
    if target.exists() and not is_complete(target):
        # Something incomplete sits at the target (not ours: we never write there directly).
        trash = target.with_name(f".{target.name}.trash-{uuid.uuid4().hex[:8]}")
        os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and is_complete(target):
            logger.info("another process finished converting %s first; using it", target.name)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; the cached model is not a secret, and
    who may reach it is decided by the modes of the cache directories above it."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _remove_stale_temps(target: Path) -> None:
    """Drop temp dirs left by interrupted conversions. Called under the lock: none is live."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        logger.info("removing leftover of an interrupted conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[bool]:
    """Hold an advisory lock on ``lock_path``; yields False (no lock) where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic rename alone keeps us safe
        yield False
        return
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting the same model (%s)", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
