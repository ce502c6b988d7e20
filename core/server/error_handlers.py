"""How the server answers what its routes raise: each exception class its status, and a
body that fails validation a message naming the field and what it takes (the shape itself
is errors.py's)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cadence.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from cadence.server.errors import error_response
from cadence.server.limits import DeadlineExceeded
from cadence.server.protocol import RequestError

# Body fields whose values are JSON objects with keys of the client's choosing.
_MAPPING_FIELDS = frozenset({"logit_bias"})


def install_error_handlers(app: FastAPI, bodies: dict[str, type]) -> None:
    """Every exception a route raises, answered in the error shape of its path (errors.py);
    ``bodies`` (path -> body model) lists the valid fields for an unknown one."""
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        err = errors[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        key = ""
        if loc and loc[0] in _MAPPING_FIELDS:
            # Inside a mapping the next location is a key the client chose ("logit_bias.5",
            # or one that reads like a union tag): name the field, and the key beside it.
            key = f" (key {loc[1]!r})" if len(loc) > 1 else ""
            loc = loc[:1]
        # A field with a union type (``prompt``, a message's ``content``, an item of
        # ``input``) fails once per branch, each error's location tagged with the branch
        # ("prompt.str", "input.list[...].0.MessageItem.content"): say what is wrong in the
        # branch the client meant (union_problem), not the first branch's complaint.
        union = union_problem(errors, bodies.get(request.url.path)) \
            if any(_is_branch_tag(x) for x in loc) else None
        field = ".".join(loc) or None
        if union is not None:
            field, message = union
        elif field is None:  # the body as a whole: none, not JSON-typed, or not an object
            message = _body_problem(request.headers.get("content-type", ""), err)
        elif err.get("type") == "extra_forbidden":
            model = bodies.get(request.url.path)
            valid = sorted(model.model_fields) if model is not None else []
            message = f"unknown field {field!r}; valid fields: {', '.join(valid)}"
        elif err.get("type") == "json_invalid":
            field = None
            message = f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
        elif err.get("type") == "missing":
            message = f"{field} is required"
        else:
            message = f"{field}{key}: {err.get('msg')}" if field else str(err.get("msg"))
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


def _is_branch_tag(segment: str) -> bool:
    """True for the union-branch tags pydantic puts in an error's location: a shape
    ("str", "list[int]") or a model's class name (body fields are snake_case)."""
    return "[" in segment or segment in {"str", "int", "float", "bool", "dict"} or \
        segment[:1].isupper()


def union_problem(errors: list[dict], body: type | None) -> tuple[str, str]:
    """(field, message) for a body whose union fields failed in every branch.

    A branch is ruled out where its shape does not match (an error at the branch's tag:
    a list given for a string) or where it is a model whose ``type`` is another literal
    than the one sent (or not sent): those say "not this one". What is left is the branch
    the client meant, and its first error is the one to name. With nothing left, the
    deepest union is named with the shapes it takes, or the ``type`` values it knows."""
    paths = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    out: set[tuple[str, ...]] = set()
    for e, loc in zip(errors, paths):
        if _is_branch_tag(loc[-1]):
            out.add(tuple(loc))  # shape mismatch: the value is not of this branch's type
        elif len(loc) > 1 and loc[-1] == "type" and loc[-2][:1].isupper() and \
                e.get("type") in ("literal_error", "missing"):
            out.add(tuple(loc[:-1]))  # a model of another kind
    # The branches whose shape the value had (it failed inside them, not at their tag),
    # by the union's location.
    inside: dict[tuple[str, ...], set[str]] = {}
    for loc in paths:
        for i, x in enumerate(loc[:-1]):
            if _is_branch_tag(x):
                inside.setdefault(tuple(loc[:i]), set()).add(x)
    for e, loc in zip(errors, paths):
        tags = [i for i, x in enumerate(loc) if _is_branch_tag(x)]
        # A branch was meant where it is a model whose type matched, or the one shape the
        # value had; a list of numbers that fails as list[str] at index 0 and as list[int]
        # at 1 meant neither.
        if any(not loc[i][:1].isupper() and inside.get(tuple(loc[:i])) != {loc[i]}
               for i in tags):
            continue
        if not any(tuple(loc[:i + 1]) in out for i in tags):
            return _named(e, loc, body)
    # Nothing fits: the deepest union the value reached, by its shapes or its kinds.
    shape_at = max((loc[:-1] for loc in paths if _is_branch_tag(loc[-1])), key=len,
                   default=[])
    kinds_at = [loc[:-2] for loc in paths if len(loc) > 1 and loc[-1] == "type"
                and loc[-2][:1].isupper()]
    if kinds_at and len(max(kinds_at, key=len)) >= len(shape_at):
        where = max(kinds_at, key=len)
        kinds = []
        for e, loc in zip(errors, paths):
            expected = e.get("ctx", {}).get("expected")
            if loc[:-2] == where and expected and expected not in kinds:
                kinds.append(expected)
        field = ".".join([*_plain(where), "type"])
        return field, f"{field} must be one of: {', '.join(kinds)}"
    field = ".".join(_plain(shape_at))
    shapes = []
    n = len(shape_at)
    for loc in paths:
        if loc[:n] == shape_at and len(loc) > n and _is_branch_tag(loc[n]) and \
                loc[n] not in shapes:
            shapes.append(loc[n])
    return field, f"{field} has the wrong type or value; it must be one of: " + \
        ", ".join(shapes)


def _plain(loc: list[str]) -> list[str]:
    return [x for x in loc if not _is_branch_tag(x)]


def _named(err: dict, loc: list[str], body: type | None) -> tuple[str, str]:
    """The message for one error inside the branch the client meant."""
    field = ".".join(_plain(loc))
    if err.get("type") == "missing":
        return field, f"{field} is required"
    if err.get("type") == "extra_forbidden":
        owner = loc[-2] if len(loc) > 1 and loc[-2][:1].isupper() else None
        model = _models(body).get(owner) if owner else body
        valid = f"; valid fields: {', '.join(model.model_fields)}" if model else ""
        return field, f"unknown field {field!r}{valid}"
    return field, f"{field}: {err.get('msg')}"


def _models(body: type | None) -> dict[str, type]:
    """The pydantic models reachable from ``body``'s fields, by class name."""
    found: dict[str, type] = {}
    todo = [body] if body is not None else []
    while todo:
        model = todo.pop()
        for f in getattr(model, "model_fields", {}).values():
            for t in _types_in(f.annotation):
                if hasattr(t, "model_fields") and t.__name__ not in found:
                    found[t.__name__] = t
                    todo.append(t)
    return found


def _types_in(annotation: object) -> list[object]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types_in(a)]
