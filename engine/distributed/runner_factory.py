"""The engine core's model runner (``engine.runner.protocol.Runner``): one ``ModelRunner`` over
the whole model, or with ``tensor_parallel_size > 1`` rank 0's
``engine.distributed.tp_runner.TensorParallelRunner``
(imported only then: a single-device engine never loads torch.distributed)."""

from __future__ import annotations

from typing import Any

from engine.config.engine import EngineConfig
from engine.runner.protocol import Runner


def build_runner(config: EngineConfig, hf_config: Any, files, max_model_len: int) -> Runner:
    """The runner for ``config``; with tensor parallelism its workers are spawned here."""
    if config.tensor_parallel_size == 1:
        from engine.loading.loader import iter_weights
        from engine.runner.model_runner import ModelRunner

        return ModelRunner(config, hf_config, iter_weights(files), max_model_len,
                           files_dir=files.path)
    from engine.distributed.tp_runner import TensorParallelRunner

    return TensorParallelRunner.launch(config, hf_config, files, max_model_len)
