"""How the server answers what its routes raise: each exception class its status, and a
body that fails validation a message naming the field and what it takes
(validation_errors.py; the shape itself is errors.py's)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cadence.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from cadence.server.errors import error_response
from cadence.server.limits import DeadlineExceeded
from cadence.server.protocol import RequestError
from cadence.server.validation_errors import ErrorNamer


def install_error_handlers(app: FastAPI, bodies: dict[str, type]) -> None:
    """Every exception a route raises, answered in the error shape of its path (errors.py);
    ``bodies`` (path -> body model) lists the valid fields for an unknown one."""
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        err = errors[0]
        field: str | None = None
        if not [x for x in err.get("loc", ()) if x != "body"]:
            # The body as a whole: none, not JSON-typed, or not an object.
            message = _body_problem(request.headers.get("content-type", ""), err)
        elif err.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
        else:
            field, message = ErrorNamer(bodies.get(request.url.path)).name(errors)
        return error_response(400, message, field, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own 400s (a body that is not UTF-8), 404s and 405s, in the OpenAI
        # error shape every other answer has.
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = _unparsable(exc.__cause__)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code, path=request.url.path)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        # A FieldError (the engine's own checks) names its field.
        return error_response(400, str(exc), getattr(exc, "param", None),
                              path=request.url.path)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(429, str(exc), headers={"Retry-After": "1"},
                              path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), path=request.url.path)

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        # The engine's fault, not the client's: 500, and the others were served.
        return error_response(500, str(exc), path=request.url.path)

    @app.exception_handler(DeadlineExceeded)
    async def past_deadline(request: Request, exc: DeadlineExceeded) -> JSONResponse:
        return error_response(504, str(exc), code="request_timeout", path=request.url.path)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # A fault of ours: still the error shape clients parse, not Starlette's plain
        # text (Starlette logs the traceback after this answer).
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              path=request.url.path)


def _body_problem(content_type: str, err: dict) -> str:
    """Why a body that is no request object was refused (its fields were not reached)."""
    if content_type and "json" not in content_type.split(";")[0].lower():
        # FastAPI reads such a body as bytes, never as JSON.
        return ("the body must be JSON sent with 'Content-Type: application/json', got "
                f"'Content-Type: {content_type[:60]}'")
    if err.get("type") == "missing":
        return "the request has no body; it must be a JSON object"
    if not content_type and isinstance(err.get("input"), (bytes, bytearray)):
        return ("the body must be JSON sent with 'Content-Type: application/json'; the "
                "request has no Content-Type")
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    got = kinds.get(type(err.get("input")), "something else")
    return f"the body must be a JSON object with the request's fields, got {got}"


def _unparsable(cause: BaseException | None) -> str:
    """The message for a body the JSON decoder gave up on with something else than a
    JSONDecodeError (FastAPI's "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not valid JSON (it is not UTF-8 text)"
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON this server reads: it is nested too deeply"
    if isinstance(cause, ValueError):  # an integer past Python's 4300-digit limit
        return f"the body is not valid JSON this server reads: {str(cause).split(';')[0]}"
    return "the body could not be parsed as JSON"
