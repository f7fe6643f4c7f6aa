"""A precompiled header for a kernel build: GCC parses ``torch_lite.h`` (ATen's tensor type and
its factories) once instead of once per source.

That header is most of a small kernel source's compile
(docs/decisions.md#kernel-build-precompiled-header).
:func:`precompile` writes ``HEADER.gch`` beside the copied header with the flags torch's
cpp_extension compiles every source with; GCC then reads it wherever a source's first include
is that header. Where the flags do not match (another torch's defaults, another compiler) GCC
ignores the file and parses the header as before: the same objects either way, only slower.
:func:`remove` deletes it once the build is done (it is large: hundreds of MB).
"""

from __future__ import annotations

import logging
import subprocess
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

from engine import envs

logger = logging.getLogger("kvserve.engine")


def _std_flag() -> str:
    """The C++ standard torch's cpp_extension passes (c++20 since torch 2.8, c++17 before)."""
    from torch.utils import cpp_extension

    text = Path(cpp_extension.__file__).read_text()
    return "-std=c++20" if "'-std=c++20', '-fPIC'" in text else "-std=c++17"


def flags(name: str, src: Path, cflags: Sequence[str]) -> list[str]:
    """cpp_extension's compile flags for a CPU extension ``name`` whose sources are in
    ``src``: its defines, include paths, ``-fPIC``, the standard, then ``cflags``."""
    from torch.utils.cpp_extension import include_paths

    out = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{src}"]
    for path in [*include_paths(), sysconfig.get_paths()["include"]]:
        out += ["-isystem", path]
    return [*out, "-fPIC", _std_flag(), *cflags]


def precompile(name: str, src: Path, header: str, cflags: Sequence[str]) -> bool:
    """Write ``src/HEADER.gch``; True when it was written (a failure is logged and ignored:
    the build parses the header itself)."""
    start = time.perf_counter()
    out = src / f"{header}.gch"
    cmd = [envs.cxx(), *flags(name, src, cflags), "-Wno-pragma-once-outside-header",
           "-x", "c++-header", str(src / header), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("no precompiled header for %s (%s)", name, exc)
        return False
    if done.returncode != 0 or not out.is_file():
        logger.info("no precompiled header for %s: %s", name,
                    (done.stderr.strip().splitlines() or ["failed"])[-1][:300])
        out.unlink(missing_ok=True)
        return False
    logger.info("%s: %s precompiled in %.1f s", name, header, time.perf_counter() - start)
    return True


def remove(src: Path, header: str) -> None:
    (src / f"{header}.gch").unlink(missing_ok=True)
