"""Request bodies of the embeddings, rerank and score endpoints (OpenAI's, Jina/Cohere's as
vLLM and llama.cpp serve them, vLLM's score). Unknown fields are accepted and ignored, as in
server/protocol.py; empty inputs are refused naming the field."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictInt, StrictStr, model_validator

from server.field_error import FieldError
from server.protocol import _Request

NonNegInt = Annotated[StrictInt, Field(ge=0)]
EmbeddingInput = StrictStr | list[StrictStr] | list[NonNegInt] | list[list[NonNegInt]]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _not_empty(self) -> EmbeddingRequest:
        i = self.input
        if isinstance(i, str):
            return self
        if not i:
            raise FieldError("input", "must not be empty")
        if isinstance(i[0], list) and any(not sub for sub in i):
            raise FieldError("input", "must not hold an empty list of token ids")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The input as a list: strings, or token-id lists."""
        i = self.input
        if isinstance(i, str):
            return [i]
        if isinstance(i[0], int):
            return [list(i)]
        return list(i)


class TextDocument(BaseModel):
    text: StrictStr


class RerankRequest(_Request):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | TextDocument]
    top_n: StrictInt | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True
    # the reranker's task text (Qwen3-Reranker's <Instruct>); None: the model card's default
    instruction: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _not_empty(self) -> RerankRequest:
        if not self.documents:
            raise FieldError("documents", "must not be empty")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Request):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    instruction: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        a, b = self.lists()
        if not a or not b:
            raise FieldError("text_1" if not a else "text_2", "must not be empty")
        if len(a) > 1 and len(a) != len(b):
            raise FieldError("text_2", f"text_1 has {len(a)} texts and text_2 {len(b)}: "
                                       f"give one text_1, or as many as text_2")
        return self

    def lists(self) -> tuple[list[str], list[str]]:
        a = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        b = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        return a, b

    def pairs(self) -> list[tuple[str, str]]:
        a, b = self.lists()
        if len(a) == 1:
            a = a * len(b)
        return list(zip(a, b, strict=True))
