"""How long the CPU kernels take to compile from scratch: the sources of two git revisions, each
built into a fresh temporary folder with the flags engine/cpu/kernels.py uses, one after the
other in the same run (most of a first ``make install`` on two cores is this build).

    python benchmarks/kernel_build.py                      # HEAD~1 vs the working tree
    python benchmarks/kernel_build.py --base 798a4ec --repeats 1

Prints wall and compiler CPU seconds per revision and the ratio, with the CPU's ISA.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grammar_backends import cpu_isa  # noqa: E402

CSRC = "engine/cpu/csrc"


def sources_at(rev: str | None, dest: Path) -> None:
    """The kernel sources of ``rev`` (None: the working tree) copied into ``dest``."""
    dest.mkdir(parents=True)
    if rev is None:
        for p in (ROOT / CSRC).iterdir():
            if p.suffix in (".cpp", ".h"):
                (dest / p.name).write_bytes(p.read_bytes())
        return
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (dest / name).write_bytes(blob)


def build_once(src: Path, root: Path) -> tuple[float, float]:
    """Wall seconds and the compilers' CPU seconds of one build of ``src`` under ``root``, in
    a process of its own (two builds of one module cannot both be imported into one)."""
    code = ("import sys; from pathlib import Path; from engine.cpu import kernels; "
            "from engine.cpu.build import build; src = Path(sys.argv[1]); "
            "build('kvserve_cpu_kernels_bench', [src / s for s in kernels._SOURCES], "
            "include_dir=src, cflags=['-O3', '-march=native', '-fopenmp'], "
            "ldflags=['-fopenmp'], root=Path(sys.argv[2]), is_python_module=False)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(src), str(root)], cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="the revision to compare against")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {args.base: [], "working tree": []}
    with tempfile.TemporaryDirectory(prefix="kvserve-kbuild-") as tmp:
        for r in range(args.repeats):
            for label, rev in ((args.base, args.base), ("working tree", None)):
                src = Path(tmp) / f"src-{r}-{len(results[label])}-{rev or 'tree'}"
                sources_at(rev, src)
                results[label].append(build_once(src, Path(tmp) / f"root-{src.name}"))
                print(f"{label}: {results[label][-1][0]:.1f} s wall", flush=True)
    print(f"CPU: {cpu_isa()}")
    base_wall = min(w for w, _ in results[args.base])
    for label, runs in results.items():
        wall, cpu = min(runs)
        print(f"{label:<14} wall {wall:6.1f} s  compiler CPU {cpu:6.1f} s  "
              f"ratio {wall / base_wall:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
