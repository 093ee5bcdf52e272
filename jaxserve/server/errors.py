"""Error responses: OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and on Anthropic's
Messages routes (/v1/messages...) Anthropic's, `{"type": "error", "error": {"type", "message"}}`."""

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

ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_ROUTES = "/v1/messages"  # the path prefix whose errors take Anthropic's shape

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


def anthropic_error_body(status: int, message: str) -> dict:
    """The JSON body Anthropic's API sends with an error (and in a stream's `error` event)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _respond(request: Request, status: int, message: str, param: str | None = None, code: str | int | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the route's API: Anthropic's on its Messages routes, else OpenAI's."""
    if request.url.path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, param, code, headers)


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return _respond(request, error.status, error.message, error.param, error.code, error.headers)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's errors as one 400 that names the first offending field."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid" or not param:
        return _respond(request, 400, _body_problem(request, first), None)
    return _respond(request, 400, f"{param}: {first.get('msg')}", param)


JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
                   type(None): "null"}


def _body_problem(request: Request, first: dict) -> str:
    """What is wrong with the body as a whole (pydantic's first error about it), in words that say what to send."""
    if first.get("type") == "json_invalid":  # FastAPI puts the character's position after "body" in the location
        position = first.get("loc", ("body",))[1:]
        where = f" at character {position[0]}" if position else ""
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}{where}"
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type and content_type != "application/json":
        return (f"the request body must be a JSON object sent with Content-Type: application/json, not "
                f"{content_type} (curl's -d sends a form unless given -H 'Content-Type: application/json')")
    if first.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    kind = JSON_TYPE_NAMES.get(type(first.get("input")), "not an object")
    return f"the request body must be a JSON object ({{...}}), got {kind}"


def _is_union_tag(part) -> bool:
    """True for the union-branch names pydantic puts in an error's location (`str`, `list[int]`, ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
                                       or "-" in part)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    return _respond(request, error.status_code, str(error.detail), headers=getattr(error, "headers", None))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug, not bad input: 500, still in the route's API's shape."""
    logger.exception("internal error while serving a request", exc_info=error)
    return _respond(request, 500, f"internal error: {type(error).__name__}: {error}")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    RequestValidationError: _validation_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}
