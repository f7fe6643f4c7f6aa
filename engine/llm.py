"""Offline API in vLLM's shape: ``LLM(model=None, **overrides).generate(prompts, params)``.

Also ``chat`` (through ``engine.chat_template.render_chat``, the one templating path), ``stream``
(one request's outputs as they come: ``kvserve generate``) and ``stats()`` (the engine's
``EngineStats`` flattened to a dict). Requests are validated by the core's ``check_request``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.chat_template import render_chat
from engine.config.engine import EngineConfig
from engine.core import EngineCore
from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.request_output import RequestOutput


class LLM:
    """Runs generation to completion in the calling thread.

    ``model=None`` is the embedded SmolLM2-135M-Instruct; overrides are ``EngineConfig`` field
    names (block_size, kv_cache_memory, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        self._start(EngineConfig.from_overrides(model=model, **overrides))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an already validated config (``kvserve generate``'s flags and file)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine's workers (tensor parallelism); the LLM cannot generate after.
        Also at exit and on garbage collection; idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 images: Seq[Seq[PromptImage]] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        ``images``: per prompt, the images on its image placeholders (a vision model's;
        ``engine.params.prompt_image``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"got images for {len(images)} prompts, not {len(prompts)}")
        ids = []
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            if isinstance(prompt, str):
                token_ids, text = self.tokenizer.encode(prompt), prompt
            else:
                token_ids, text = list(prompt), None
            rid = str(next(self._ids))
            self.engine.add_request(rid, token_ids, p, prompt=text,
                                    images=tuple(images[k]) if images is not None else ())
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
               prompt: str | None = None) -> Iterator[RequestOutput]:
        """Run one request, yielding its cumulative output after every step that touched it;
        the last one is finished. Closing the iterator early aborts the request."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, list(prompt_token_ids), params or SamplingParams(),
                                prompt=prompt)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request([rid])
                while self.engine.has_unfinished_requests():
                    self.engine.step()

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [render_chat(self.tokenizer, c, add_generation_prompt=add_generation_prompt)
                    for c in convs]
        prompts = [text for text, _ in rendered]
        token_lists = [ids for _, ids in rendered]
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

    def load_lora_adapter(self, name: str, path: str) -> int:
        """Load a LoRA adapter (a PEFT directory or a LoRA GGUF) as ``name``, selected by
        ``SamplingParams(lora_name=name)``; needs ``enable_lora=True``. Returns its lora_id."""
        adapters = self.engine.adapters
        if adapters is None:
            raise ValueError("LoRA adapters are off: construct the LLM with enable_lora=True")
        return adapters.add(adapters.read(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (KeyError if it is not loaded)."""
        if self.engine.adapters is None:
            raise KeyError(name)
        self.engine.adapters.remove(name)

    def stats(self) -> dict[str, int | float]:
        """The engine's counters, flat (``EngineStats.as_dict``): preemptions, prefix-cache
        queries/hits in tokens, blocks free/used, host-tier offload counts and bytes."""
        return self.engine.stats().as_dict()
