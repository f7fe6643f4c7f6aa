"""Config files and flags: keys are flag names, flags override the file, unknown or mistyped
keys are refused with a message naming them, and every shipped preset is valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.config.engine import EngineConfig
from server.cli import _settings, build_parser, main
from server.config_file import ServerSettings, load_config_file, resolve

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def _parse(*argv: str) -> tuple[EngineConfig, ServerSettings]:
    return _settings(build_parser().parse_args(["serve", *argv]))


def test_file_values_reach_the_settings_and_flags_override_them(tmp_path):
    f = _write(tmp_path, "max-model-len: 512\nmax_num_seqs: 3\nport: 9000\n"
                         "enable-prefix-caching: false\nkv-cache-memory: 64MiB\n"
                         "served-model-name: small\napi-key: k1\n")
    engine, server = _parse("--config", str(f))
    assert (engine.max_model_len, engine.max_num_seqs, engine.enable_prefix_caching) == \
        (512, 3, False)
    assert engine.kv_cache_memory == 64 * 2**20 and engine.served_model_name == "small"
    assert (server.port, server.api_key) == (9000, "k1")
    engine, server = _parse("some/model", "--config", str(f), "--max-num-seqs", "7",
                            "--enable-prefix-caching", "--port", "9001")
    assert (engine.model, engine.max_num_seqs, engine.enable_prefix_caching) == \
        ("some/model", 7, True)
    assert engine.max_model_len == 512 and server.port == 9001  # untouched keys stay


def test_defaults_without_a_file():
    engine, server = _parse()
    assert engine == EngineConfig()
    assert server == ServerSettings()


def test_vllm_flag_names_map_onto_engine_fields():
    engine, _ = _parse("--block-size", "32", "--max-num-batched-tokens", "256",
                       "--gpu-memory-utilization", "0.5", "--swap-space", "2", "--dtype",
                       "bfloat16", "--preemption-mode", "swap", "--attention-backend", "torch",
                       "--seed", "5", "--no-enable-chunked-prefill", "--max-waiting-requests",
                       "9")
    assert (engine.block_size, engine.max_num_batched_tokens, engine.gpu_memory_utilization,
            engine.swap_space, engine.dtype, engine.preemption_mode, engine.attention_backend,
            engine.seed, engine.enable_chunked_prefill, engine.max_waiting_requests) == \
        (32, 256, 0.5, 2.0, "bfloat16", "swap", "torch", 5, False, 9)


def test_quantization_flags():
    engine, _ = _parse("--quantization", "int4", "--quantization-group-size", "128")
    assert (engine.quantization, engine.quantization_group_size) == ("int4", 128)
    assert _parse("--quantization", "int8")[0].quantization == "int8"
    assert _parse("--quantization", "none")[0].quantization_group_size == 32
    with pytest.raises(SystemExit):  # not a choice: argparse's usage error
        _parse("--quantization", "awq")
    with pytest.raises(ValueError, match="applies to quantization int4 or int8"):
        _parse("--quantization-group-size", "128")


@pytest.mark.parametrize("text,fragment", [
    ("max-modle-len: 5\n", "unknown key(s) in config file"),
    ("max-num-seqs: lots\n", "max-num-seqs must be of type int"),
    ("max-num-seqs: 2.5\n", "must be an integer"),
    ("enable-prefix-caching: 'yes'\n", "must be true or false"),
    ("dtype: float64\n", "dtype must be one of"),
    ("port: null\n", "port cannot be null"),
    ("- a\n- b\n", "must hold a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_files_are_refused_with_a_clear_message(tmp_path, text, fragment):
    with pytest.raises(ValueError) as info:
        load_config_file(_write(tmp_path, text))
    assert fragment in str(info.value)


def test_unknown_key_message_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as info:
        load_config_file(_write(tmp_path, "max-modle-len: 5\n"))
    assert "max-modle-len" in str(info.value) and "max-model-len" in str(info.value)


def test_engine_validation_errors_surface(tmp_path):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        resolve({}, _write(tmp_path, "block-size: 12\n"))


def test_kv_eviction_flag_and_key(tmp_path):
    engine, _ = _parse("--kv-eviction", "sink:4,window:1024")
    assert engine.kv_eviction == "sink:4,window:1024"
    assert (engine.eviction_spec().sink, engine.eviction_spec().window) == (4, 1024)
    engine, _ = _parse("--config", str(_write(tmp_path, "kv-eviction: sink:0,window:64\n")))
    assert engine.eviction_spec().window == 64
    assert _parse()[0].kv_eviction is None
    with pytest.raises(ValueError, match="sink:S,window:N"):
        _parse("--kv-eviction", "window:64")


def test_cli_reports_config_errors_as_usage_errors(tmp_path, capsys):
    f = _write(tmp_path, "bogus: 1\n")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(f)])
    assert info.value.code == 2
    assert "unknown key(s)" in capsys.readouterr().err


def test_print_config_round_trips(tmp_path, capsys):
    f = _write(tmp_path, "max-model-len: 300\nport: 1234\napi-key: secret\n")
    assert main(["serve", "--config", str(f), "--block-size", "8", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "secret" not in printed  # the key is masked
    data = yaml.safe_load(printed)
    assert data["max-model-len"] == 300 and data["block-size"] == 8 and data["port"] == 1234
    data.pop("api-key")
    engine, server = resolve({}, _write(tmp_path, yaml.safe_dump(data)))
    # serve's own default (the probe after the ready line) is printed like any value
    assert engine == EngineConfig(max_model_len=300, block_size=8, cpu_probe="background")
    assert server == ServerSettings(port=1234)


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert _parse()[1].api_key == "from-env"
    assert _parse("--api-key", "flag")[1].api_key == "flag"


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_presets_are_valid(preset):
    engine, server = resolve({}, preset)
    assert isinstance(engine, EngineConfig) and isinstance(server, ServerSettings)


def test_generate_prints_the_completion(monkeypatch, capsys):
    import engine.llm
    from tests.server.fakes import FakeCore

    monkeypatch.setattr(engine.llm, "EngineCore", lambda config: FakeCore())
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out == "Hiabcd\n" and "4 generated" in out.err
    assert main(["generate", "--prompt", "Hi", "--chat", "--max-tokens", "3", "--stop",
                 "c"]) == 0
    out = capsys.readouterr()
    assert out.out == "ab\n" and "finish_reason=stop" in out.err


def test_plugin_subcommands_are_registered_when_present():
    parser = build_parser()
    choices = set(parser._subparsers._group_actions[0].choices)  # argparse keeps them here
    expected = {"serve", "generate"}
    if (ROOT / "server" / "bench" / "cli.py").exists():
        expected |= {"bench", "kv-calc"}
    assert expected <= choices


def test_hardening_flags_and_keys(tmp_path):
    engine, server = _parse()
    assert (engine.max_seqs_per_request, engine.scheduling_policy) == (None, "fcfs")
    assert engine.seqs_per_request_cap == engine.max_num_seqs
    assert (server.max_request_body_size, server.limit_concurrency, server.stream_timeout,
            server.trust_request_chat_template) == (32 * 2**20, 1024, 60.0, False)
    engine, server = _parse("--max-seqs-per-request", "8", "--scheduling-policy", "priority",
                            "--max-request-body-size", "1MiB", "--limit-concurrency", "0",
                            "--stream-timeout", "5", "--trust-request-chat-template")
    assert (engine.max_seqs_per_request, engine.seqs_per_request_cap,
            engine.scheduling_policy) == (8, 8, "priority")
    assert (server.max_request_body_size, server.limit_concurrency, server.stream_timeout,
            server.trust_request_chat_template) == (2**20, None, 5.0, True)
    f = _write(tmp_path, "max-seqs-per-request: 3\nscheduling-policy: fcfs\n"
                         "max-request-body-size: 64KiB\nlimit-concurrency: null\n"
                         "stream-timeout: 0\ntrust-request-chat-template: true\n")
    engine, server = resolve({}, f)
    assert (engine.max_seqs_per_request, server.max_request_body_size, server.limit_concurrency,
            server.stream_timeout, server.trust_request_chat_template) == \
        (3, 64 * 1024, None, 0.0, True)


def test_connection_flags_and_keys(tmp_path):
    _, server = _parse()
    assert (server.header_timeout, server.body_timeout, server.max_connections_per_client) \
        == (10.0, 60.0, 256)
    _, server = _parse("--header-timeout", "2.5", "--body-timeout", "0",
                       "--max-connections-per-client", "0")
    assert (server.header_timeout, server.body_timeout, server.max_connections_per_client) \
        == (2.5, 0.0, None)
    f = _write(tmp_path, "header-timeout: 3\nmax-connections-per-client: 16\n")
    _, server = resolve({}, f)
    assert (server.header_timeout, server.max_connections_per_client) == (3.0, 16)


@pytest.mark.parametrize("text,fragment", [
    ("max-request-body-size: 10\n", "max-request-body-size must be at least 1KiB"),
    ("max-request-body-size: lots\n", "cannot read"),
    ("limit-concurrency: -1\n", "limit-concurrency cannot be negative"),
    ("stream-timeout: -1\n", "stream-timeout cannot be negative"),
    ("header-timeout: -1\n", "header-timeout cannot be negative"),
    ("body-timeout: .nan\n", "body-timeout cannot be negative"),
    ("max-connections-per-client: -2\n", "max-connections-per-client cannot be negative"),
    ("scheduling-policy: lottery\n", "scheduling-policy must be one of"),
    ("max-seqs-per-request: 0\n", "max_seqs_per_request must be >= 1"),
])
def test_bad_hardening_values_are_refused(tmp_path, text, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve({}, _write(tmp_path, text))


@pytest.mark.parametrize(("given", "canonical"), [
    (["--model", "/m"], ["/m"]),
    (["-m", "/m"], ["/m"]),
    (["-c", "4096", "-np", "8"], ["--max-model-len", "4096", "--max-num-seqs", "8"]),
    (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]),
    (["--trust-remote-code", "--generation-config", "vllm"], ["--generation-config", "vllm"]),
    (["--served-model-name", "a"], ["--served-model-name", "a"]),
])
def test_vllm_and_llama_cpp_spellings_parse_as_the_canonical_ones(given, canonical):
    """vLLM's and llama.cpp's forms of the same settings give the same resolved config."""
    assert _parse(*given) == _parse(*canonical)


def test_a_list_of_served_names_reports_the_first_and_keeps_the_model(tmp_path):
    engine, _ = _parse(*["/m", "--served-model-name", "a", "b"])
    assert engine.model == "/m" and engine.served_model_names == ("a", "b")
    path = tmp_path / "c.yaml"
    path.write_text("served-model-name: [x, y]\n")
    assert _parse(*["--config", str(path)])[0].served_model_names == ("x", "y")
    with pytest.raises(ValueError, match="two models"):
        _parse(*["/m", "--model", "/n"])


def test_help_shows_each_flags_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in text and "(default: 16)" in text
    assert "(default: background for kvserve serve, cached for kvserve generate" in text


def test_tool_calling_flags_and_keys(tmp_path):
    _, s = _parse()
    assert (s.tool_call_parser, s.enable_auto_tool_choice) == (None, True)
    _, s = _parse("--tool-call-parser", "llama3_json", "--enable-auto-tool-choice")
    assert (s.tool_call_parser, s.enable_auto_tool_choice) == ("llama3_json", True)
    f = _write(tmp_path, "tool-call-parser: hermes\nenable-auto-tool-choice: false\n")
    _, s = resolve({}, f)
    assert (s.tool_call_parser, s.enable_auto_tool_choice) == ("hermes", False)
    _, s = _parse("--tool-call-parser", "mistral")
    assert s.tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        resolve({}, _write(tmp_path, "tool-call-parser: pythonic\n"))
