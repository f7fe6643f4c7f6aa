"""The import graph of ``engine/``, ``server/`` and ``kvserve_kernels/`` has no cycles, and neither
``engine/`` nor ``kvserve_kernels/`` imports ``server/`` (docs/design.md: the engine never sees HTTP).

The graph is read from the source with ``ast``, nothing is imported. What counts as an edge:

* every ``import a.b`` and ``from a.b import c`` of one of the three packages, anywhere in a
  file: at module level and also inside functions and methods. A lazy import breaks no import
  at start-up, but it is still a dependency, and a circle that holds only because one side
  imports late is the tangle this test is here to keep out. Imports under
  ``if TYPE_CHECKING:`` never run, and the layering rules leave them out; the circle test
  counts them too (a circle held only by a type annotation is still two modules that
  cannot be read apart);
* relative imports are resolved against the importing module's package;
* ``from pkg import name`` is an edge to the submodule ``pkg.name`` when that module exists,
  else to ``pkg`` itself; an import of ``a.b.c`` where ``c`` is no module (a name inside
  ``a.b``) is an edge to ``a.b``;
* a package's ``__init__.py`` is its own node (``engine``), and its re-exports are edges
  from it (``engine`` -> ``engine.llm``). Python runs ``engine/__init__.py`` before any
  ``engine.x``, but that implicit parent-package import is not an edge: with it every package
  that re-exports one of its own modules would be a circle, and the public
  ``from engine import LLM, SamplingParams`` is meant to work. An explicit
  ``from engine import LLM`` inside ``engine/`` still is an edge to ``engine``, and closes
  a real circle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "kvserve_kernels", "loadgen")
# Packages whose modules must not import ``server``.
BELOW_SERVER = ("engine", "kvserve_kernels")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function or method


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            modules[module_name(path, root)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def raw_imports(source: str, module: str, is_package: bool, type_checking: bool = False,
                ) -> list[tuple[str, list[str], int, bool]]:
    """``(absolute module, imported names, line, lazy)`` for every import statement that can
    run (and, with ``type_checking``, those under ``if TYPE_CHECKING:`` too), with relative
    imports resolved. ``names`` is empty for ``import x``."""
    found: list[tuple[str, list[str], int, bool]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, [], node.lineno, lazy))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names], node.lineno, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``, or None (outside them)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def build_graph(modules: dict[str, Path], type_checking: bool = False) -> list[Edge]:
    edges: list[Edge] = []
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for target, names, line, lazy in raw_imports(path.read_text(), mod, is_package,
                                                     type_checking):
            targets = []
            if names:
                for name in names:
                    sub = f"{target}.{name}"
                    targets.append(sub if sub in modules else target)
            else:
                targets.append(target)
            for t in targets:
                resolved = _resolve(t, modules)
                if resolved is not None and resolved != mod:
                    edges.append(Edge(mod, resolved, line, lazy))
    return edges


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for n in sorted(nodes):
        if n not in index:
            connect(n)
    return sorted(comps)


def one_cycle(comp: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest circle through the component's first module, as the edges that make it."""
    members = set(comp)
    out: dict[str, list[Edge]] = {}
    for e in edges:
        if e.source in members and e.target in members:
            out.setdefault(e.source, []).append(e)
    start = comp[0]
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in sorted(out.get(v, []), key=lambda e: (e.target, e.line)):
                if e.target == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if e.target not in came:
                    came[e.target] = e
                    nxt.append(e.target)
        frontier = nxt
    return []


def describe(comp: list[str], edges: list[Edge], modules: dict[str, Path]) -> str:
    lines = [f"import cycle among {len(comp)} modules: {', '.join(comp)}", "  for example:"]
    for e in one_cycle(comp, edges):
        where = modules[e.source].relative_to(ROOT)
        lines.append(f"    {e.source} -> {e.target}   ({where}:{e.line}"
                     f"{', inside a function' if e.lazy else ''})")
    return "\n".join(lines)


def test_no_import_cycles():
    modules = find_modules()
    edges = build_graph(modules)
    comps = strongly_connected(list(modules), edges)
    assert not comps, "\n\n".join(describe(c, edges, modules) for c in comps)


def test_no_import_cycles_even_through_type_checking_imports():
    """A circle closed only under ``if TYPE_CHECKING:`` (llama <-> cpu_decode_stack was one)
    is still two modules that cannot be read apart: the model declares the small protocol it
    needs instead (``llama.FastDecodeStack``)."""
    modules = find_modules()
    edges = build_graph(modules, type_checking=True)
    comps = strongly_connected(list(modules), edges)
    assert not comps, "\n\n".join(describe(c, edges, modules) for c in comps)
    pairs = {(e.source, e.target) for e in edges}
    assert ("engine.models.cpu_decode_stack", "engine.models.llama") in pairs
    assert ("engine.models.llama", "engine.models.cpu_decode_stack") not in pairs


def test_engine_and_kernels_never_import_server():
    modules = find_modules()
    bad = [
        f"{e.source} -> {e.target}   ({modules[e.source].relative_to(ROOT)}:{e.line})"
        for e in build_graph(modules)
        if e.source.split(".")[0] in BELOW_SERVER and e.target.split(".")[0] == "server"
    ]
    assert not bad, "engine/ and kvserve_kernels/ must not import server/:\n" + "\n".join(bad)


def test_only_the_cli_imports_the_loadgen_package():
    """``loadgen/`` (the client behind ``kvserve bench`` and ``kvserve kv-calc``): the server reaches it
    through ``server/cli.py``; nothing in engine/, kvserve_kernels/ or the rest of server/ imports it."""
    modules = find_modules()
    bad = [e for e in build_graph(modules)
           if e.target.split(".")[0] == "loadgen" and e.source.split(".")[0] != "loadgen"
           and e.source != "server.cli"]
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def test_the_walker_sees_the_real_graph():
    """Guards the two tests above against passing because they read nothing."""
    modules = find_modules()
    assert {"engine", "engine.llm", "server", "kvserve_kernels", "kvserve_kernels.paged_decode"} <= set(modules)
    edges = {(e.source, e.target): e for e in build_graph(modules)}
    assert ("engine", "engine.llm") in edges  # a package re-export
    assert ("kvserve_kernels.paged_decode", "kvserve_kernels.tiles") in edges
    lazy = edges[("engine.attention.backend", "engine.attention.triton_backend")]
    assert lazy.lazy  # the backend is imported only when chosen


def test_import_rules_on_a_synthetic_module():
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
import engine.sampling.sampler as s
from . import sibling
from .. import penalties
from ..kv_cache.manager import KVCacheManager

if TYPE_CHECKING:
    from server.app import build_app
else:
    from engine import fallback

def f():
    from kvserve_kernels.store_kv import store_kv
"""
    found = {(t, tuple(n), lazy) for t, n, _, lazy in
             raw_imports(source, "engine.sub.mod", is_package=False)}
    assert ("engine.sampling.sampler", (), False) in found
    assert ("engine.sub", ("sibling",), False) in found
    assert ("engine", ("penalties",), False) in found
    assert ("engine.kv_cache.manager", ("KVCacheManager",), False) in found
    assert ("engine", ("fallback",), False) in found
    assert ("kvserve_kernels.store_kv", ("store_kv",), True) in found
    assert not any(t.startswith("server") for t, _, _ in found)
    typed = {t for t, *_ in raw_imports(source, "engine.sub.mod", False, type_checking=True)}
    assert "server.app" in typed
    # In a package's __init__, "." is the package itself.
    pkg = {t for t, *_ in raw_imports("from .llm import LLM", "engine", is_package=True)}
    assert pkg == {"engine.llm"}


def test_the_runner_seam_is_one_call():
    """The runner package sees plain data, never the scheduler; the core reaches the runner
    through ``Runner.execute(plan)`` and never sees the packed batch (issue 30)."""
    modules = find_modules()
    edges = build_graph(modules)
    bad = [f"{e.source} -> {e.target}   ({modules[e.source].relative_to(ROOT)}:{e.line})"
           for e in edges
           if (e.source.startswith("engine.runner") and e.target.startswith("engine.scheduling"))
           or (e.source == "engine.core" and e.target == "engine.runner.batch")]
    assert not bad, "the runner seam is crossed:\n" + "\n".join(bad)
    assert ("engine.core", "engine.runner.protocol") in {(e.source, e.target) for e in edges}


# The floors of the house, lowest first (docs/design.md, "The parts"). A module stands on the
# floor of its longest listed prefix. An import may go down or stay on its floor, never up.
FLOORS: tuple[tuple[str, ...], ...] = (
    # 1. process environment: env vars, the cache directory, timers, Triton kept out
    ("engine.envs", "engine.profiling", "engine.cache_dir", "engine.chat_template",
     "engine.triton_import"),
    # 2. shared options and request types: every layer reads them, they import no feature
    ("engine.config", "engine.params", "engine.request_output"),
    # 3. kernels and the device's K/V row formats: functions over tensors
    ("engine.cpu", "kvserve_kernels", "engine.kv_format"),
    # 4. the scheduler's per-request state
    ("engine.request",),
    # 5. libraries the model and the sampler are built from (vision: Gemma 3's image encoder)
    ("engine.quantization", "engine.attention", "engine.sampling", "engine.lora",
     "engine.vision"),
    # 6. the architectures (with TP's rank state), and the step's messages
    ("engine.models", "engine.step"),
    # 7. KV bookkeeping, checkpoints, pooling, per-request finishing
    ("engine.kv_cache", "engine.loading", "engine.pooling", "engine.postprocess"),
    # 8. weight preparation, KV events over the KV cache's hooks
    ("engine.weight_prep", "engine.kv_events"),
    # 9. the model side of a step
    ("engine.runner",),
    # 10. runners built from runners: tensor parallelism, the speculative draft model
    ("engine.distributed", "engine.spec_decode"),
    # 11. constrained decoding (its jump-forward drafts use spec_decode's n-gram search)
    ("engine.structured",),
    # 12. the scheduler and the typed counters
    ("engine.scheduling", "engine.stats"),
    # 13. the core and its assembly
    ("engine.core", "engine.assembly", "engine.core_stats", "engine.adapters"),
    # 14. the engine's faces
    ("engine.async_engine", "engine.llm", "engine"),  # "engine": its __init__.py alone
    # 15. the benchmark client (`kvserve bench`), a client of the engine and the server's API
    ("loadgen",),
    # 16. HTTP
    ("server",),
)

# (importer, imported): the imports allowed to run up a floor, each with its reason.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {
    ("engine.request", "engine.postprocess.stop"):
        "a type annotation only (under TYPE_CHECKING): a Sequence holds the SequenceTextState"
        " that postprocess builds and drives",
}


def floor_of(module: str) -> int | None:
    best, floor = -1, None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "engine"
            if (module == p or inside) and len(p) > best:
                best, floor = len(p), i
    return floor


def test_every_module_stands_on_a_floor():
    missing = [m for m in find_modules() if floor_of(m) is None]
    assert not missing, "modules on no floor (add them to FLOORS):\n" + "\n".join(missing)


def test_no_import_runs_up_a_floor():
    """Lazy imports and ``TYPE_CHECKING`` imports count too: each is still a dependency."""
    modules = find_modules()
    bad, used = [], set()
    for e in build_graph(modules, type_checking=True):
        src, dst = floor_of(e.source), floor_of(e.target)
        if src is None or dst is None or dst <= src:
            continue
        if (e.source, e.target) in UPWARD_ALLOWED:
            used.add((e.source, e.target))
            continue
        bad.append(f"{e.source} (floor {src + 1}) -> {e.target} (floor {dst + 1})   "
                   f"({modules[e.source].relative_to(ROOT)}:{e.line})")
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)
    assert len(UPWARD_ALLOWED) <= 4
    assert used == set(UPWARD_ALLOWED), f"allowed but gone: {set(UPWARD_ALLOWED) - used}"
