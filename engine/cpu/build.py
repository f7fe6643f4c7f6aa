"""Build a C++ extension once per machine, safely: a folder named by what the build depends on,
a lock that dies with its holder, and progress while it compiles.

:func:`build` keeps each build in ``<cache dir>/cpu-kernels/<name>-<hash>/`` (the hash covers
sources, flags, compiler, torch and Python versions and the CPU: :func:`build_key`), publishes
it by renaming a private temporary folder into place, and serialises builders with an ``flock``
that the kernel drops when the holder dies; a waiter gives up after ``wait_s`` with
:class:`BuildWaitTimeout`. The full contract is on :func:`build`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine import envs
from engine.cache_dir import default_cache_dir
from engine.cpu.pch import precompile
from engine.cpu.pch import remove as remove_pch

logger = logging.getLogger("kvserve.engine")
DEFAULT_WAIT_S = 900.0  # a build takes 1.5-7 minutes on two cores; past this something is wrong


class BuildWaitTimeout(RuntimeError):
    """Another live process held the build lock for longer than the wait allowed."""


def build_root() -> Path:
    return default_cache_dir() / "cpu-kernels"


def cpu_identity() -> str:
    """This CPU's model name and flags (``-march=native`` code built on one CPU may not run
    on another: a cache folder can outlive the machine it was built on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags") and name not in fields:
            fields[name] = value.strip()
    return f"{fields.get('model name', '?')}|{fields.get('flags', '')}"


def build_key(sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str],
              include_dirs: Sequence[Path] = ()) -> str:
    """A hash of everything the compiled library depends on (see :func:`build`) and of
    the CPU it is built on."""
    import torch

    h = hashlib.sha256()
    files = {p.resolve() for p in sources}
    for d in include_dirs:
        files |= {p.resolve() for p in Path(d).glob("*.h")}
    for path in sorted(files, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (*cflags, "|", *ldflags, "|", envs.cxx(), torch.__version__,
                 sys.version.split()[0], cpu_identity()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def exclusive(lock_path: Path, wait_s: float = DEFAULT_WAIT_S,
              log_every_s: float = 10.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block; wait for a
    holder at most ``wait_s`` seconds, logging whom we wait for, then raise
    :class:`BuildWaitTimeout`. The lock is released when the block ends or the process dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = last_log = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                holder = _holder(lock_path)
                if now - start >= wait_s:
                    raise BuildWaitTimeout(
                        f"waited {now - start:.0f} s for another process (pid {holder}) building "
                        f"in {lock_path.with_suffix('')}; if that process is stuck, stop it (the "
                        f"lock goes with it) or remove the folder to build afresh") from None
                if now - last_log >= log_every_s or now == start:
                    logger.info("waiting for another kvserve process building the kernels "
                                "(pid %s, %s), %.0f s so far", holder,
                                lock_path.with_suffix(""), now - start)
                    last_log = now
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "?"
    except OSError:
        return "?"


def build(name: str, sources: Sequence[Path], *, include_dir: Path | None = None,
          cflags: Sequence[str] = (), ldflags: Sequence[str] = (), is_python_module: bool = True,
          wait_s: float | None = None, root: Path | None = None, pch: str | None = None):
    """The extension ``name`` from ``sources``: loaded straight from its folder when built,
    else compiled with torch's cpp_extension in a private temporary folder renamed into place
    when done. Returns the module, or the library's path when ``is_python_module`` is False (as
    ``cpp_extension.load`` does). ``wait_s`` defaults to ``$KVSERVE_KERNEL_BUILD_WAIT`` or
    :data:`DEFAULT_WAIT_S`. Build errors propagate. Contract:

    * The build lives in ``<cache dir>/cpu-kernels/<name>-<hash>/``, the hash covering the
      sources' bytes (and every header beside them), the flags, the compiler (``$CXX``),
      torch's and Python's versions and the CPU (model and flags). Different sources or flags
      never share or overwrite a build; the same sources anywhere reuse it (they are copied
      into the folder and compiled there). A restart with the build in place only loads it.
    * A finished build is published by renaming its private temporary folder into place, with a
      marker naming its library; later starts import that library directly (no lock, no ninja,
      so venvs with the same torch share one build).
    * Builders take an exclusive ``flock`` on ``<folder>.lock``, which the kernel drops when the
      holder dies however it dies, so a killed build is never waited on; its temporary folder
      (and any ``lock`` baton of torch's cpp_extension in it) is removed by the next builder.
    * A process that finds the lock held logs whom it waits for (the holder's pid is in the
      lock file) every ``log_every_s`` and gives up after ``wait_s`` with
      :class:`BuildWaitTimeout`, whose message names the folder and the pid.
    * While it compiles, a progress bar counts the object files done out of the sources.
    * ``pch``: a header of ``include_dir`` precompiled first (``engine.cpu.pch``) for the
      sources that include it first; removed before publishing."""
    sources = [Path(s) for s in sources]
    includes = [include_dir] if include_dir is not None else []
    key = build_key(sources, cflags, ldflags, includes)
    folder = (root or build_root()) / f"{name}-{key}"
    if wait_s is None:
        env_wait = envs.kernel_build_wait_s()
        wait_s = DEFAULT_WAIT_S if env_wait is None else env_wait
    if (folder / _DONE).is_file():  # published: no lock, no ninja
        return _load_built(folder, is_python_module)
    with exclusive(folder.with_suffix(".lock"), wait_s):
        if (folder / _DONE).is_file():  # built by the process we waited for
            return _load_built(folder, is_python_module)
        _remove_dead_builds(folder)
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        src = tmp / "src"
        src.mkdir(parents=True)
        for path in [*sources, *(p for d in includes for p in Path(d).glob("*.h"))]:
            shutil.copyfile(path, src / path.name)
        logger.info("building %s (%d sources; once per machine, about 1 minute on two quiet cores) "
                    "in %s", name, len(sources), folder)
        from torch.utils.cpp_extension import load as load_ext

        if pch is not None:
            precompile(name, src, pch, cflags)
        with _progress(tmp, len(sources)):
            out = load_ext(name=name, sources=[str(src / p.name) for p in sources],
                           extra_include_paths=[str(src)] if includes else None,
                           extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                           build_directory=str(tmp), is_python_module=is_python_module,
                           verbose=False)
        if pch is not None:
            remove_pch(src, pch)
        library = next(tmp.glob("*.so"))
        (tmp / _DONE).write_text(library.name)
        shutil.rmtree(folder, ignore_errors=True)  # an unpublished leftover
        tmp.rename(folder)
        return out if is_python_module else str(folder / library.name)


_DONE = "kvserve-built"  # written last into a finished build, naming its library


def _load_built(folder: Path, is_python_module: bool):
    """Import (or, for a plain library, load into torch.ops) the published build's library."""
    library = folder / (folder / _DONE).read_text().strip()
    if not is_python_module:
        import torch

        torch.ops.load_library(str(library))
        return str(library)
    import importlib.util

    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_dead_builds(folder: Path) -> None:
    """Delete every temporary build folder of ``folder``. Call under the lock: whoever left one
    no longer holds the lock, so it died mid-build (a compiler it left running writes only
    there, and fails harmlessly once the folder is gone)."""
    for tmp in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _progress(folder: Path, total: int) -> Iterator[None]:
    """A tqdm bar of the object files ninja has finished in ``folder`` (to stderr)."""
    from tqdm import tqdm

    done = threading.Event()

    def watch() -> None:
        with tqdm(total=total, desc="compiling CPU kernels", unit="file", leave=True) as bar:
            while not done.wait(1.0):
                n = min(total, len(list(folder.glob("*.o"))))
                bar.update(n - bar.n)
            bar.update(min(total, len(list(folder.glob("*.o")))) - bar.n)

    thread = threading.Thread(target=watch, name="kernel-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
