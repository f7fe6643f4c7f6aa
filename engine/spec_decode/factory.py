"""Building the proposer a ``SpeculativeConfig`` names (the core calls it once at start-up)."""

from __future__ import annotations

import logging

from engine.config.engine import EngineConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer

logger = logging.getLogger("kvserve.engine")


def build_proposer(config: EngineConfig, *, max_model_len: int, vocab_size: int,
                   num_blocks: int) -> Proposer:
    """The proposer of ``config.speculative_config``. A draft model is loaded here with the
    target's device, dtype, block size and quantization, its pool given ``num_blocks`` blocks
    (as the target's; times its KV groups for a draft whose layers mix window and full
    attention, whose blocks are one group's pages); ValueError when its vocabulary differs from the target's
    ``vocab_size`` or its context is shorter than ``max_model_len``."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min or 1,
                             spec.prompt_lookup_max or 1)
    from engine.loading.loader import iter_weights, load_config, resolve_model
    from engine.runner.model_runner import ModelRunner
    from engine.spec_decode.draft_model import DraftModelProposer

    files = resolve_model(spec.model)
    hf_config = load_config(files)
    draft_vocab = int(getattr(hf_config, "vocab_size", 0))
    if draft_vocab != vocab_size:
        raise ValueError(f"the draft model {spec.model} has a vocabulary of {draft_vocab} "
                         f"tokens, the target {vocab_size}: a draft must share the tokenizer")
    positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if positions and positions < max_model_len:
        raise ValueError(f"the draft model {spec.model} handles {positions} positions, fewer "
                         f"than max_model_len {max_model_len}: lower --max-model-len")
    draft_cfg = config.replace(model=spec.model, tokenizer=None, speculative_config=None,
                               swap_space=0.0, preemption_mode="recompute")
    runner = ModelRunner(draft_cfg, hf_config, iter_weights(files), max_model_len,
                         files_dir=files.path)
    # a hybrid draft's blocks are pages of one of its KV groups: as many of them per group,
    # the same bytes as a one-group draft's pool
    num_blocks *= runner.kv_layout.num_groups
    runner.allocate_kv_cache(num_blocks)
    runner.prepare_for_serving()
    logger.info("draft model %s: %.1f MiB of weights, %d KV blocks (%.2f GiB)", files.name,
                runner.weight_bytes / 2**20, num_blocks, runner.kv_pool_bytes() / 2**30)
    return DraftModelProposer(runner, num_blocks, config.block_size, spec.num_speculative_tokens,
                              max_step_tokens=config.max_num_batched_tokens)
