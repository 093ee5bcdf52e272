"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

logger = logging.getLogger("jaxserve")


class APIError(Exception):
    """An error to send to the client with `status` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The JSON body OpenAI sends with an error."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying an OpenAI-shaped error."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code, error.headers)


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's errors as one 400 that names the first offending field."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('msg')}", None)
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return error_response(400, message, param)


def _is_union_tag(part) -> bool:
    """True for the union-branch names pydantic puts in an error's location (`str`, `list[int]`, ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
                                       or "-" in part)


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    return error_response(error.status_code, str(error.detail), headers=getattr(error, "headers", None))


async def _internal_error(_: Request, error: Exception) -> JSONResponse:
    """A bug, not bad input: 500, still in OpenAI's shape."""
    logger.exception("internal error while serving a request", exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}: {error}")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}
