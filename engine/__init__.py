"""kvserve engine: paged KV cache, continuous batching, Llama-family models."""

from engine.config.engine import EngineConfig
from engine.params.sampling import SamplingParams
from engine.request_output import CompletionOutput, Logprob, RequestOutput


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; import it lazily so light users stay light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "Logprob"]
