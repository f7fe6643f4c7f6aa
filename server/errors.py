"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can see goes through here: validation (ours and FastAPI's) is 400, an
unknown model 404, a bad API key 401, an overloaded or stopping server 503 with ``Retry-After``,
and anything unexpected 500 with a generic message (the traceback goes to the log only).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a handler."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = printable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = printable(param) if param is not None else None
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def printable(text: str) -> str:
    """``text``, with any lone surrogate escaped: a message may quote what a client sent, and
    such a string cannot be encoded as the UTF-8 of a JSON response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def internal_error(request_id: str | None = None) -> APIError:
    ref = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"The server had an error while processing the request{ref}; "
                         "see the server log.", code="internal_error")


# What a field accepts, for fields whose type is a union (pydantic reports one error per member).
_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id "
              "lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts",
}


def _clean_loc(err: dict[str, Any]) -> list[str]:
    if err.get("type") == "json_invalid":  # its loc is a position in the body, not a field
        return []
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic names the union member tried ("str", "list[int]", "function-after[...]").
    return [x for x in loc if not any(c in x for c in "[]") and x not in
            ("str", "int", "float", "bool", "tagged-union")]


def _message(err: dict[str, Any]) -> str:
    kind = err.get("type")
    if kind == "json_invalid":
        where = [x for x in err.get("loc", ()) if isinstance(x, int)]
        at = f" at character {where[-1]}" if where else ""
        return (f"the body is not valid JSON{at} "
                f"({(err.get('ctx') or {}).get('error', 'parse error')})")
    if kind == "missing":
        return "this field is required"
    return str(err.get("msg", "invalid value")).removeprefix("Value error, ")


def format_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message for pydantic/FastAPI errors, and the first offending parameter."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        loc = _clean_loc(err)
        groups.setdefault(loc[0] if loc else "", []).append(err)
    parts, first_param = [], None
    for err in errors:  # our own FieldError names its parameter itself
        param = getattr((err.get("ctx") or {}).get("error"), "param", None)
        if param:
            first_param = first_param or param
    for field, errs in groups.items():
        if len(errs) > 1 and field:
            # A union: prefer the errors about values over "wrong type for member X".
            specific = [e for e in errs if not str(e.get("type", "")).endswith("_type")]
            if specific:
                errs = specific[:1]
            else:
                last = _clean_loc(errs[0])[-1]
                hint = _UNION_HINTS.get(last, "has the wrong type")
                param = ".".join(_clean_loc(errs[0]))
                first_param = first_param or param
                parts.append(f"{param}: {hint}")
                continue
        for err in errs:
            param = ".".join(_clean_loc(err)) or None
            first_param = first_param or param
            msg = _message(err)
            parts.append(f"{param}: {msg}" if param else msg)
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    return "; ".join(seen[:5]) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_errors(list(exc.errors()))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = str(exc.detail)
        if status == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return APIError(status, message, headers=getattr(exc, "headers", None)).response()
