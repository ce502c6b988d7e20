"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for every status
the server answers with, whether from a route, an exception handler or a middleware."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The error object; streams send it as an event once their headers are gone."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """The error as an HTTP response with ``status``."""
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)
