"""Offline API in vLLM's shape: ``LLM(model=None, **overrides).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Runs generation to completion in the calling thread.

    ``model=None`` is the embedded SmolLM2-135M-Instruct; overrides are ``EngineConfig`` field
    names (block_size, kv_cache_memory, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        self.config = EngineConfig.from_overrides(model=model, **overrides)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params):
            if isinstance(prompt, str):
                token_ids, text = self.tokenizer.encode(prompt), prompt
            else:
                token_ids, text = list(prompt), None
            rid = str(next(self._ids))
            self.engine.add_request(rid, token_ids, p, prompt=text)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
                   for c in convs]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(token_lists, params, use_tqdm=use_tqdm)
        for out, text in zip(outs, prompts):
            out.prompt = text
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def stats(self) -> dict[str, int | float]:
        return self.engine.stats()
