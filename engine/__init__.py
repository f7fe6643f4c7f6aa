"""kvserve engine: paged KV cache, continuous batching, Llama-family models."""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling.params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; import it lazily so light users stay light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "Logprob"]
