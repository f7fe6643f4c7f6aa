"""speculative_config: vLLM's JSON object, validated into a SpeculativeConfig, from Python,
the command line and YAML config files."""

from __future__ import annotations

import pytest
import yaml

from engine.config.engine import EngineConfig
from engine.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from server.config_file import as_yaml_dict, resolve


def test_forms_and_defaults():
    c = EngineConfig(speculative_config={"method": "ngram"}).speculative_config
    assert c == SpeculativeConfig()
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 4, 2)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    c = EngineConfig(speculative_config=text).speculative_config
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 5, 1)
    c = SpeculativeConfig.from_value({"method": "ngram", "prompt_lookup_min": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)  # vLLM: a lone min sets both
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config="null").speculative_config is None
    forced = SpeculativeConfig.from_value({"method": "ngram", "disable_by_batch_size": None})
    assert forced.speculates_at(10_000)
    assert not SpeculativeConfig(disable_by_batch_size=2).speculates_at(3)
    assert SpeculativeConfig(disable_by_batch_size=2).speculates_at(2)


@pytest.mark.parametrize("value, message", [
    ({"num_speculative_tokens": 4}, 'needs "method"'),
    ({"method": "medusa"}, "method must be one of ngram, draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": True}, "integer in 1..16"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "model": "x"}, '"model" is for method "draft_model"'),
    ({"method": "ngram", "num_spec_tokens": 4}, "unknown speculative_config key.*num_spec"),
    ({"method": "draft_model"}, 'needs "model"'),
    ({"method": "draft_model", "model": "m", "prompt_lookup_max": 3}, "are for method \"ngram\""),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_values_are_refused_with_a_message(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_draft_model_form():
    c = SpeculativeConfig.from_value({"method": "draft_model", "model": "/models/small",
                                      "num_speculative_tokens": 5})
    assert (c.model, c.num_speculative_tokens, c.prompt_lookup_max) == ("/models/small", 5, None)
    assert c.as_dict() == {"method": "draft_model", "model": "/models/small",
                           "num_speculative_tokens": 5,
                           "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
    assert SpeculativeConfig.from_value(c.as_dict()) == c


def test_llm_overrides_accept_the_dict():
    c = EngineConfig.from_overrides(speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2})
    assert c.speculative_config.num_speculative_tokens == 2


def test_flag_file_and_print_config_round_trip(tmp_path):
    flag = '{"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": null}'
    engine, server = resolve({"speculative_config": flag})
    assert engine.speculative_config.num_speculative_tokens == 5
    assert engine.speculative_config.disable_by_batch_size is None
    f = tmp_path / "c.yaml"
    f.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    from_file, _ = resolve({}, f)
    assert from_file.speculative_config.num_speculative_tokens == 3
    printed = yaml.safe_dump(as_yaml_dict(engine, server))
    f.write_text(printed)
    again, _ = resolve({}, f)
    assert again == engine


def test_cli_flag_parses(monkeypatch):
    from server.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert resolve(vars(args))[0].speculative_config.num_speculative_tokens == 2
