"""The LoRA options of the one options table (server/config_file.py): vLLM's flags and their
YAML keys reach ``EngineConfig`` / ``ServerSettings``, both ``--lora-modules`` forms parse, a
config file round-trips through ``--print-config``, and the runtime-updating gate also comes
from ``KVSERVE_ALLOW_RUNTIME_LORA_UPDATING``."""

from __future__ import annotations

import pytest
import yaml

from engine.config.engine import EngineConfig
from server.cli import _settings, build_parser, main
from server.config_file import SERVE_DEFAULTS, ServerSettings, resolve


def _parse(*argv: str) -> tuple[EngineConfig, ServerSettings]:
    return _settings(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(autouse=True)
def _no_gate_in_the_environment(monkeypatch):
    monkeypatch.delenv("KVSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)


def test_defaults_are_off():
    engine, server = _parse()
    assert not engine.enable_lora and engine.lora_modules == ()
    assert (engine.max_loras, engine.max_lora_rank) == (4, 16)
    assert not server.allow_runtime_lora_updating


def test_vllm_flags_reach_the_settings():
    engine, server = _parse("--enable-lora", "--lora-modules", "sql=/a/sql",
                            '{"name": "chat", "path": "/a/chat", "base_model_name": "x"}',
                            "--max-loras", "2", "--max-lora-rank", "8",
                            "--allow-runtime-lora-updating")
    assert engine.enable_lora
    assert engine.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert (engine.max_loras, engine.max_lora_rank) == (2, 8)
    assert server.allow_runtime_lora_updating


def test_yaml_keys_take_both_forms_and_print_config_round_trips(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("enable-lora: true\nlora-modules:\n  - sql=/a/sql\n"
                 "  - {name: chat, path: /a/chat}\nmax-lora-rank: 32\n"
                 "allow-runtime-lora-updating: true\n")
    engine, server = resolve({}, f, SERVE_DEFAULTS)  # as `kvserve serve` reads it
    assert engine.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert engine.max_lora_rank == 32 and server.allow_runtime_lora_updating
    assert main(["serve", "--config", str(f), "--print-config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["lora-modules"] == ["sql=/a/sql", "chat=/a/chat"]
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(data))
    assert resolve({}, again, SERVE_DEFAULTS) == (engine, server)


def test_one_module_as_a_yaml_mapping(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("enable-lora: true\nlora-modules: {name: sql, path: /a/sql}\n")
    assert resolve({}, f)[0].lora_modules == (("sql", "/a/sql"),)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--lora-modules", "sql=/a/sql"], "enable_lora"),  # modules without --enable-lora
    (["--enable-lora", "--lora-modules", "no-path"], "name=path"),
    (["--enable-lora", "--lora-modules", '{"name": "x"}'], '"path"'),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "twice"),
    (["--enable-lora", "--max-loras", "0"], "max_loras"),
])
def test_bad_lora_options_are_refused(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        _parse(*argv)


@pytest.mark.parametrize(("value", "on"), [("1", True), ("True", True), ("true", True),
                                           ("0", False), ("False", False), ("", False)])
def test_runtime_updating_gate_from_the_environment(monkeypatch, value, on):
    monkeypatch.setenv("KVSERVE_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert _parse()[1].allow_runtime_lora_updating is on
    assert not _parse("--no-allow-runtime-lora-updating")[1].allow_runtime_lora_updating
