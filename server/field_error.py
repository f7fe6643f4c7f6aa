"""``FieldError``: a validation error about one request parameter (re-exported by
``server.protocol``; its own module so that the parts protocol.py uses can raise it)."""

from __future__ import annotations


class FieldError(ValueError):
    """A validation error about one parameter (``param``, dotted), raised inside a model
    validator, where pydantic would otherwise name no field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
