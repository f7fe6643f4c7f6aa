"""Tensor-parallel configuration and launch plans (engine/config/engine.py, engine/distributed/launcher.py):
validation, where ranks run and meet, and core pinning. No processes are started."""

from __future__ import annotations

import pytest

from engine.config.engine import EngineConfig
from engine.distributed.launcher import launch_plan, split_cores


@pytest.mark.parametrize("changes,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=4, nnodes=3), "nnodes must be >= 1 and divide"),
    (dict(tensor_parallel_size=4, nnodes=2, node_rank=2), "node_rank must be in 0..1"),
    (dict(distributed_timeout=0), "distributed_timeout"),
    (dict(tensor_parallel_size=2, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True),
     "calculate_kv_scales is not supported"),
])
def test_config_refuses_what_cannot_run(changes, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**changes)


def test_from_overrides_knows_the_parallel_fields():
    cfg = EngineConfig.from_overrides(None, tensor_parallel_size=2, distributed_timeout=5)
    assert cfg.tensor_parallel_size == 2 and cfg.distributed_timeout == 5


def test_split_cores_is_disjoint_and_near_even():
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores([0, 1, 2, 3, 4], 2) == [(0, 1), (2, 3, 4)]
    assert split_cores([3], 2) is None


def test_one_host_spawns_the_other_ranks_on_a_loopback_port():
    plan = launch_plan(EngineConfig(tensor_parallel_size=2), env={})
    assert plan.local_ranks == (0, 1) and plan.spawn == (1,)
    assert plan.init_method.startswith("tcp://127.0.0.1:") and plan.backend == "gloo"
    setup = plan.setup(1, 7.0)
    assert (setup.rank, setup.world_size, setup.timeout_s) == (1, 2, 7.0)


def test_second_host_runs_its_own_ranks_and_needs_a_meeting_point():
    cfg = EngineConfig(tensor_parallel_size=4, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="distributed-init-method"):
        launch_plan(cfg, env={})
    plan = launch_plan(cfg.replace(distributed_init_method="tcp://10.0.0.1:29500"), env={})
    assert plan.local_ranks == (2, 3) and plan.spawn == (2, 3)
    assert plan.init_method == "tcp://10.0.0.1:29500"
    plan = launch_plan(cfg, env={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"})
    assert plan.init_method == "tcp://10.0.0.1:29501"
    head = launch_plan(cfg.replace(node_rank=0), env={"MASTER_ADDR": "h0", "MASTER_PORT": "1"})
    assert head.local_ranks == (0, 1) and head.spawn == (1,)


def test_torchrun_environment_means_one_rank_per_process():
    cfg = EngineConfig(tensor_parallel_size=2)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1"}
    plan = launch_plan(cfg, env=env)
    assert plan.local_ranks == (1,) and plan.spawn == () and plan.init_method == "env://"
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        launch_plan(cfg, env={**env, "WORLD_SIZE": "4"})


def test_cuda_ranks_use_nccl():
    assert launch_plan(EngineConfig(tensor_parallel_size=2), env={},
                       device_type="cuda").backend == "nccl"


def test_each_local_rank_gets_its_own_device_index():
    plan = launch_plan(EngineConfig(tensor_parallel_size=4, nnodes=2, node_rank=1,
                                    distributed_init_method="tcp://h0:1"), env={})
    assert [plan.setup(r, 5).local_rank for r in (2, 3)] == [0, 1]
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert launch_plan(EngineConfig(tensor_parallel_size=4), env=env).setup(3, 5).local_rank == 1
