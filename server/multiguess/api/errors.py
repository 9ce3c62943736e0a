"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Clients (the ``openai`` package among them) turn that shape into typed exceptions; a 500 or a
bare text body would tell them nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from multiguess.errors import InvalidRequestError
from multiguess.scheduler import EngineFailure, NotReady, Overloaded, RequestTimeout, ShuttingDown

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as the OpenAPI document lists it."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses an operation really returns."""
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


# What a generation endpoint may answer besides 200 (the gate's, validation's, admission's,
# the engine's): the document lists them so that clients and fuzzers know them.
GENERATION_ERRORS = error_responses(400, 401, 404, 408, 413, 415, 422, 429, 500, 503, 504)


class APIError(Exception):
    """An error with the status and the OpenAI fields it is reported with."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_exception(exc: Exception) -> APIError:
    """Map what the scheduler and engine raise to the status a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, Overloaded):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, NotReady):
        return APIError(503, str(exc), code="not_ready", headers={"Retry-After": "5"})
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), code="request_timeout")
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), code="engine_failure")
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable sentence from pydantic's errors, and the first offending parameter."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        param = param or where or None
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
        else:
            parts.append(f"{where or 'body'}: {err.get('msg', 'invalid value')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def install(app: FastAPI) -> None:
    """Register handlers so that no error escapes in another shape."""

    def respond(err: APIError) -> JSONResponse:
        body = error_body(err.status, err.message, err.param, err.code)
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    async def known(_: Request, exc: Exception) -> JSONResponse:
        return respond(from_exception(exc))

    for kind in (APIError, InvalidRequestError, Overloaded, NotReady, RequestTimeout, EngineFailure):
        app.add_exception_handler(kind, known)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return respond(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return respond(APIError(exc.status_code, message, headers=dict(exc.headers or {})))

    # Anything else is a bug; Starlette still logs its traceback after this response.
    app.add_exception_handler(Exception, known)
