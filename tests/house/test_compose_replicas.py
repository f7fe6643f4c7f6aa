"""docker/compose.replicas.yaml (docs/scale-out.md) parses, and what it runs is what the
programs accept: every kvserve replica's command uses only flags ``kvserve serve --help``
knows, with values the server's own argument parser takes (the JSON of --kv-events-config,
the Redis URL); the routers' flags are in their installed ``--help`` (skipped without the
wheels); Prometheus scrapes every replica and the router."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.replicas.yaml"
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _expand(arg: str) -> str:
    """Compose's ``${VAR:-default}`` -> the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def _help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(FLAG.findall(out.stdout))


def _replicas(compose: dict) -> dict[str, list[str]]:
    return {name: [_expand(str(a)) for a in svc["command"]]
            for name, svc in compose["services"].items() if svc.get("image") == "kvserve:latest"}


def test_the_file_names_its_services(compose):
    services = compose["services"]
    assert {"replica-1", "replica-2", "replica-3", "redis", "router", "prometheus"} \
        <= set(services)
    assert len(_replicas(compose)) == 3
    redis = services["redis"]["command"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru"
    prom = yaml.safe_load((COMPOSE.parent / "prometheus.replicas.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}
    assert {"replica-1:8000", "replica-2:8000", "replica-3:8000", "router:29000"} <= targets
    mount = services["prometheus"]["volumes"][0].split(":")[0]
    assert (COMPOSE.parent / mount).resolve() == \
        (COMPOSE.parent / "prometheus.replicas.yml").resolve()


def test_replica_commands_use_only_flags_kvserve_serve_knows(compose):
    known = _help_flags(["-m", "server.cli", "serve"])
    assert {"--kv-events-config", "--kv-remote-url", "--served-model-name"} <= known
    from server.cli import build_parser

    parser = build_parser()
    for name, cmd in _replicas(compose).items():
        flags = [a.split("=", 1)[0] for a in cmd if a.startswith("--")]
        assert flags and set(flags) <= known, (name, set(flags) - known)
        # the entrypoint runs `kvserve serve --host H --port P ARGS`: the server's parser
        # takes them, values included
        args = parser.parse_args(["serve", "--host", "0.0.0.0", "--port", "8000", *cmd])
        events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] is True
        assert cmd[cmd.index("--kv-remote-url") + 1].startswith("redis://redis:6379/")
        assert args.kv_remote_url == "redis://redis:6379/0"


@pytest.mark.parametrize("service, module", [("router", "vllm_router"),
                                             ("sglang-router", "sglang_router")])
def test_router_commands_use_only_flags_the_router_knows(compose, service, module):
    pytest.importorskip(module)
    cmd = compose["services"][service]["command"]
    assert cmd[:3] == ["python", "-m", f"{module}.launch_router"]
    known = _help_flags(["-m", f"{module}.launch_router"])
    flags = {a for a in cmd if a.startswith("--")}
    assert flags <= known, flags - known
    workers = cmd[cmd.index("--worker-urls") + 1:]
    assert workers == [f"http://replica-{i}:8000" for i in (1, 2, 3)]
