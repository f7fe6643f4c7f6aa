"""SamplingParams: normalisation and validation (every bad value names its field)."""

from __future__ import annotations

import math

import pytest

from engine.params.sampling import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=0, logit_bias={"50": 1, 7: -2.5}, stop_token_ids=None)
    assert p.stop == ["###"]
    assert p.top_k == -1
    assert p.logit_bias == {50: 1.0, 7: -2.5}
    assert p.stop_token_ids == []
    assert SamplingParams(stop=["", "x", ""]).stop == ["x"]  # empty strings would match anywhere
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_clone_revalidates():
    p = SamplingParams(max_tokens=5)
    assert p.clone(max_tokens=9).max_tokens == 9 and p.max_tokens == 5
    with pytest.raises(ValueError, match="max_tokens"):
        p.clone(max_tokens=0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf),
    ("max_tokens", 0), ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -1), ("prompt_logprobs", -1), ("logprobs", True),
    ("seed", 1.5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


@pytest.mark.parametrize("bias", [{-1: 1.0}, {5: 100.5}, {5: math.nan}, {"x": 1.0}, {5: "a"}])
def test_bad_logit_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_bad_stop():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", 3])


@pytest.mark.parametrize("kwargs, message", [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop has 65 strings; at most 64"),
    ({"stop": ["x" * 1001]}, "1001 characters; at most 1000"),
    ({"stop": "y" * 1001}, "1001 characters; at most 1000"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids has 1025 ids; at most 1024"),
    ({"logit_bias": {i: 1.0 for i in range(2049)}}, "logit_bias has 2049 entries; at most 2048"),
])
def test_per_token_work_lists_are_capped(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_caps_allow_their_limits():
    p = SamplingParams(stop=[f"{i:04d}" * 250 for i in range(64)],
                       stop_token_ids=list(range(1024)),
                       logit_bias={i: 1.0 for i in range(2048)})
    assert len(p.stop) == 64 and len(p.stop_token_ids) == 1024 and len(p.logit_bias) == 2048
