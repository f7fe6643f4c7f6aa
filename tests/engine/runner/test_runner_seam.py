"""The runner seam (engine/runner/protocol.py): one ``execute(plan)`` call whose ``StepOutput`` is
indexed by the plan's chunks. The truth for the mapping is the runner itself on each chunk
alone: a chunk's rows in a batched step must be the logits it gets when it runs by itself."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine.config.engine import EngineConfig
from engine.distributed.tp_runner import TensorParallelRunner
from engine.loading.loader import iter_weights, load_config, resolve_model
from engine.loading.tiny import make_tiny_model_dir
from engine.runner.model_runner import ModelRunner
from engine.runner.protocol import Runner
from engine.step.output import StepOutput
from engine.step.plan import PromptLogitSpan, SeqChunk, StepPlan

PROMPT = [5, 17, 99, 3, 250, 8, 41]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("seam-tiny"), "qwen2")
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, quantization="none")
    files = resolve_model(str(path))
    torch.manual_seed(0)
    r = ModelRunner(config, load_config(files), iter_weights(files), 64)
    r.allocate_kv_cache(num_blocks=16)
    return r


def _chunks() -> tuple[SeqChunk, ...]:
    """Decode first, then a speculating decode (2 drafted tokens), a prefill chunk that does
    not reach its last token (no row sampled), a whole prompt with prompt logprobs; each on
    blocks of its own."""
    return (
        SeqChunk([11], 0, [0], True),
        SeqChunk([21, 22, 23], 4, [1, 2], True, num_draft=2),
        SeqChunk([31, 32, 33, 34, 35], 0, [3, 4], False),
        SeqChunk(PROMPT, 0, [5, 6], True,
                 prompt_logits=PromptLogitSpan(0, 6, tuple(PROMPT[1:]), 2)),
    )


def test_results_are_indexed_by_the_plans_chunks(runner):
    chunks = _chunks()
    out = runner.execute(StepPlan(chunks, 4))
    assert [(i, (r.start, r.stop)) for i, r in out.sampled] == [(0, (0, 1)), (1, (1, 4)),
                                                                 (3, (4, 5))]
    assert out.logits(1).shape[0] == 3
    with pytest.raises(KeyError):
        out.logits(2)
    [rows] = out.prompt_rows
    assert (rows.seq_index, rows.row_start, rows.row_end, rows.first_target) == (3, 0, 6, 1)
    for i in (0, 1, 3):  # each chunk alone gives the rows (and their number) the batch gave it
        alone = runner.execute(StepPlan((chunks[i],), 4))
        torch.testing.assert_close(out.logits(i), alone.logits(0))
    alone = runner.execute(StepPlan((chunks[3],), 4))
    torch.testing.assert_close(out.prompt_logprobs.target_logprobs,
                               alone.prompt_logprobs.target_logprobs)


def test_a_plan_without_chunks_only_moves_blocks(runner):
    out = runner.execute(StepPlan((), 4))
    assert out == StepOutput() and out.sample_logits is None


def test_step_output_checks_its_rows():
    with pytest.raises(ValueError, match="own 2 rows"):
        StepOutput(((0, range(0, 2)),), torch.zeros(1, 8))


def test_every_runner_declares_the_protocol(runner):
    members = [n for n, _ in inspect.getmembers(Runner) if not n.startswith("_")]
    assert {"execute", "check_health", "close", "health_check_interval",
            "allocate_kv_cache", "prepare_for_serving"} <= set(members)
    for name in members:
        assert hasattr(runner, name), f"ModelRunner lacks {name}"
        assert hasattr(TensorParallelRunner, name), f"TensorParallelRunner lacks {name}"
    assert "__getattr__" not in vars(TensorParallelRunner)  # explicit members, no proxy
    runner.check_health()
    assert runner.health_check_interval is None
