"""Every third-party module that the package, the tests or the benchmarks import is declared in
pyproject.toml (the dependencies or an extra), so that a fresh virtual environment built by the
README's commands has it. A module that is only present because this machine happened to have
it installed (scipy once was) fails here, not on a new user's machine.

Imports are read with ``ast``; an import inside ``try: ... except ImportError`` is optional and
not counted. Modules map to their distributions through the installed metadata."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"engine", "server", "kvserve_kernels", "loadgen", "tests", "benchmarks", "conftest"}
SCANNED = ("engine", "server", "kvserve_kernels", "loadgen", "tests", "benchmarks")


def _optional(handlers: list[ast.ExceptHandler]) -> bool:
    names = set()
    for h in handlers:
        for node in ast.walk(h.type) if h.type is not None else []:
            if isinstance(node, ast.Name):
                names.add(node.id)
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def imported_modules(source: str) -> set[str]:
    """Top-level names of the modules ``source`` imports unconditionally (absolute imports)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try) and _optional(node.handlers):
            for child in node.orelse + node.finalbody:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs}


def third_party_imports() -> dict[str, set[str]]:
    """module -> files importing it, for every non-stdlib, non-local module."""
    out: dict[str, set[str]] = {}
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for mod in imported_modules(path.read_text()):
                if mod in LOCAL or mod in sys.stdlib_module_names or mod == "__future__":
                    continue
                if (path.parent / f"{mod}.py").exists():  # a sibling module (tests' helpers)
                    continue
                out.setdefault(mod, set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_imported_third_party_module_is_declared():
    declared = declared_distributions()
    owners = md.packages_distributions()
    missing = []
    for mod, files in sorted(third_party_imports().items()):
        dists = {_norm(d) for d in owners.get(mod, [])}
        if not dists and _norm(mod) in declared:
            continue  # declared under its own name in an extra this environment lacks (bench)
        if not dists:
            missing.append(f"{mod} (not installed; imported by {', '.join(sorted(files)[:3])})")
        elif not dists & declared:
            missing.append(f"{mod} (from {', '.join(sorted(dists))}; imported by "
                           f"{', '.join(sorted(files)[:3])})")
    assert not missing, ("imported but not declared in pyproject.toml: " + "; ".join(missing))


def test_the_scan_sees_imports_and_skips_optional_ones():
    src = ("import a.b\nfrom c import d\nfrom . import e\n"
           "try:\n    import f\nexcept ImportError:\n    f = None\n"
           "def g():\n    import h\n")
    assert imported_modules(src) == {"a", "c", "h"}


def test_no_top_level_package_shares_a_name_with_an_installed_distribution():
    """Our top-level packages are importable by their bare names, so a distribution that ships a
    module of the same name (transformers 5.25 began to require Hugging Face's ``kernels``, which
    our Triton package was once called) is shadowed by ours, or shadows it, and whichever loses
    breaks at import. Every name pyproject.toml packages, and every benchmark script's module
    name, must belong to kvserve alone."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}
    # A benchmark runs as ``python benchmarks/x.py``, which puts benchmarks/ first on sys.path:
    # its modules' names are top-level names too (benchmarks/kernels.py once hid the same one).
    shipped |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    owners = md.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"kvserve"}) for name in shipped
               if set(owners.get(name, ())) - {"kvserve"}}
    assert not clashes, f"top-level names also shipped by other distributions: {clashes}"
