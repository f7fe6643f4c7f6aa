"""EngineConfig validation: admission limits (sequences per request, the waiting queue, the
policy) and the quantization options."""

from __future__ import annotations

import pytest

from engine.config.engine import EngineConfig
from engine.scheduling.admission import check_num_seqs, check_priority


def test_seqs_per_request_cap_defaults_to_max_num_seqs():
    assert EngineConfig(max_num_seqs=8).seqs_per_request_cap == 8
    assert EngineConfig(max_num_seqs=8, max_seqs_per_request=3).seqs_per_request_cap == 3
    with pytest.raises(ValueError, match="max_seqs_per_request must be >= 1"):
        EngineConfig(max_seqs_per_request=0)


def test_check_num_seqs_refuses_what_could_never_be_admitted():
    c = EngineConfig(max_num_seqs=16, max_waiting_requests=10)
    check_num_seqs(c, 10)
    with pytest.raises(ValueError, match="asks for 11 sequences.*max_waiting_requests"):
        check_num_seqs(c, 11)
    with pytest.raises(ValueError, match="asks for 17 sequences.*at most 16.*max_seqs_per_req"):
        check_num_seqs(EngineConfig(max_num_seqs=16), 17)


def test_scheduling_policy():
    assert EngineConfig().scheduling_policy == "fcfs"
    check_priority(EngineConfig(), 0)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        check_priority(EngineConfig(), -1)
    check_priority(EngineConfig(scheduling_policy="priority"), -1)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")


def test_admission_counts_prompt_sharing_and_the_swap_tier():
    from engine.params.sampling import SamplingParams
    from engine.scheduling.admission import AdmissionLimits, check_request

    limits = AdmissionLimits(max_model_len=512, token_id_bound=258, block_size=4,
                             num_blocks=16, swap_blocks=0)
    cfg = EngineConfig(max_num_seqs=8)
    prompt = list(range(20))  # 4 full blocks shared by every sample (the 5th holds the last)
    check_request(cfg, limits, prompt, SamplingParams(n=2, max_tokens=20))  # 10 + 6 = 16
    with pytest.raises(ValueError, match="3 samples need 22 KV blocks"):
        check_request(cfg, limits, prompt, SamplingParams(n=3, max_tokens=20))
    swap = AdmissionLimits(512, 258, 4, 16, swap_blocks=6)
    check_request(cfg, swap, prompt, SamplingParams(n=3, max_tokens=20))
    with pytest.raises(ValueError, match=r"token id 258 in the prompt .*\(0\.\.257\)"):
        check_request(cfg, limits, [1, 258], SamplingParams(max_tokens=2))


def test_quantization_choices_and_group_size():
    assert EngineConfig().quantization == "auto" and EngineConfig().quantization_group_size == 32
    for scheme in ("auto", "none", "int4", "int8"):
        assert EngineConfig(quantization=scheme).quantization == scheme
    assert EngineConfig(quantization="int4", quantization_group_size=128).quantization_group_size \
        == 128
    assert EngineConfig(quantization="int8", dtype="float32", device="cpu").dtype == "float32"
    refused = [
        (dict(quantization="int2"), "quantization must be one of auto, none, int4, int8"),
        (dict(quantization="int4", quantization_group_size=64), "must be one of 32, 128"),
        (dict(quantization_group_size=128), "applies to quantization int4 or int8"),
        (dict(quantization="int4", dtype="bfloat16"), "use dtype float32 or auto"),
        (dict(quantization="int8", device="cuda:0"), "CPU kernels only"),
    ]
    for kwargs, fragment in refused:
        with pytest.raises(ValueError, match=fragment):
            EngineConfig(**kwargs)


def test_check_limits_names_the_field_at_fault():
    from engine.scheduling.admission import FieldValueError, check_limits

    c = EngineConfig(max_num_seqs=4, max_logprobs=5)
    check_limits(c, num_prompts=2, n=2, priority=0, logprobs=5)
    cases = [(dict(num_prompts=1, n=1, priority=0, logprobs=6), "logprobs", "at most 5"),
             (dict(num_prompts=1, n=1, priority=0, logprobs=6, logprobs_param="top_logprobs"),
              "top_logprobs", "top_logprobs must be at most 5"),
             (dict(num_prompts=1, n=5, priority=0), "n", "n=5 sequences"),
             (dict(num_prompts=3, n=2, priority=0), "prompt", "3 prompts x n=2 = 6 sequences"),
             (dict(num_prompts=1, n=1, priority=3), "priority", "priority 3 is not allowed")]
    for kwargs, field, message in cases:
        with pytest.raises(FieldValueError, match=message) as exc:
            check_limits(c, **kwargs)
        assert exc.value.field == field
