"""The error body for every status the server answers with, whether from a route, an
exception handler or a middleware: OpenAI's, ``{"error": {"message", "type", "param",
"code"}}``, except on Anthropic's Messages endpoints, whose clients read Anthropic's,
``{"type": "error", "error": {"type", "message"}}`` (with ``param`` and ``code`` kept)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}
# Anthropic's error types by status (its docs' table); 503 is its "overloaded_error".
ANTHROPIC_ERROR_TYPES = {**ERROR_TYPES, 403: "permission_error", 500: "api_error",
                         503: "overloaded_error"}
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None, path: str = "") -> dict:
    """The error object for a request to ``path``; streams send it as an event once their
    headers are gone."""
    if path in ANTHROPIC_PATHS:
        return {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message,
            "param": param, "code": code}}
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None,
                   path: str = "") -> JSONResponse:
    """The error as an HTTP response with ``status`` to a request for ``path``."""
    return JSONResponse(error_body(status, message, param, code, path), status_code=status,
                        headers=headers)
