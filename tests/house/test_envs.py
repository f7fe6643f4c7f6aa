"""engine/envs.py is the one reader of the environment: the rule over the source, the table
against docs/envs.md, and the accessors reading at call time (so monkeypatching works)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kvserve_kernels", "server", "loadgen")
# Files allowed to touch os.environ besides engine/envs.py, each with its reason (e.g. one
# that builds the environment of a child process). None today.
EXCEPTIONS: dict[str, str] = {}
_OS_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environ_uses(source: str) -> list[int]:
    """Lines that read or write the process environment through ``os``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr in _OS_ENV_NAMES
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.ImportFrom) and node.module == "os"
              and any(a.name in _OS_ENV_NAMES for a in node.names)):
            lines.append(node.lineno)
    return lines


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_only_envs_reads_the_environment():
    bad = [f"{rel}:{line}" for rel, text in _sources()
           if rel != "engine/envs.py" and rel not in EXCEPTIONS
           for line in environ_uses(text)]
    assert not bad, ("read the environment through engine/envs.py (add the variable to its "
                     "table), or list the file in EXCEPTIONS with the reason:\n" + "\n".join(bad))
    assert set(EXCEPTIONS) <= {rel for rel, _ in _sources()}  # no stale exception


def test_the_rule_sees_every_spelling():
    source = ("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
              "os.environ['Z'] = '1'\nc = os.path.join('a')\n")
    assert sorted(environ_uses(source)) == [2, 3, 4, 5]
    assert environ_uses((ROOT / "engine/envs.py").read_text())  # the walker reads real files


def test_every_kvserve_variable_named_in_the_source_is_in_the_table():
    named = {m for _, text in _sources() for m in re.findall(r"\bKVSERVE_[A-Z0-9_]+", text)}
    tabled = {v.name for v in envs.VARIABLES if v.ours}
    assert named - tabled == set(), "add these to engine/envs.py's VARIABLES"
    from kvserve_kernels import launch_config  # names its variables without importing the engine

    assert (launch_config.DECODE_ENV, launch_config.PREFILL_ENV) == (envs.DECODE_CONFIG,
                                                                    envs.PREFILL_CONFIG)
    assert len(tabled) >= 11


def test_docs_envs_md_lists_every_variable_with_its_default():
    doc = (ROOT / "docs" / "envs.md").read_text().splitlines()
    for var in envs.VARIABLES:
        rows = [line for line in doc if line.startswith(f"| `{var.name}` |")]
        assert rows, f"docs/envs.md has no row for {var.name}"
        assert f"| {var.default} |" in rows[0], f"docs/envs.md: {var.name}'s default"


def test_accessors_read_at_call_time(monkeypatch):
    for name in (envs.CPU_KERNELS, envs.DECODE_STACK, envs.PACKED_LINEAR, envs.QUANT_FORCE,
                 envs.CACHE_DIR, envs.API_KEY, envs.CPU_MARCH, envs.KERNEL_BUILD_WAIT):
        monkeypatch.delenv(name, raising=False)
    assert envs.cpu_kernels_enabled() and envs.decode_stack_enabled()
    assert envs.packed_linear_choice() == "auto" and envs.cpu_march() == "native"
    assert not envs.quant_force() and envs.cache_dir() is None and envs.api_key() is None
    assert envs.kernel_build_wait_s() is None
    monkeypatch.setenv(envs.CPU_KERNELS, "0")
    monkeypatch.setenv(envs.DECODE_STACK, "no")  # only "0" turns it off, as before
    monkeypatch.setenv(envs.QUANT_FORCE, "1")
    monkeypatch.setenv(envs.CACHE_DIR, "")  # empty counts as unset
    monkeypatch.setenv(envs.KERNEL_BUILD_WAIT, "2.5")
    assert not envs.cpu_kernels_enabled() and envs.decode_stack_enabled()
    assert envs.quant_force() and envs.cache_dir() is None
    assert envs.kernel_build_wait_s() == 2.5


def test_torchrun_variables(monkeypatch):
    for name in envs.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.torchrun_env() == {} and not envs.is_torchrun_worker()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert envs.torchrun_env() == {"WORLD_SIZE": "2", "RANK": "1"}
    assert envs.is_torchrun_worker()


def test_names_outside_the_table_are_refused(monkeypatch):
    with pytest.raises(KeyError, match="VARIABLES"):
        envs.get("KVSERVE_NOT_A_VARIABLE")
    with pytest.raises(KeyError):
        envs.launch_override(envs.CACHE_DIR)
    monkeypatch.setenv(envs.DECODE_STACK, "1")  # so that monkeypatch restores it afterwards
    monkeypatch.delenv(envs.DECODE_STACK)
    envs.set_default(envs.DECODE_STACK, "0")
    assert envs.get(envs.DECODE_STACK) == "0"
