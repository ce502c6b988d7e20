"""The OpenAI-compatible HTTP server (FastAPI): routes and error mapping.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's on
its Messages endpoints, core/server/errors.py):
400 bad input (the message names the field and the valid values), 401 no or a wrong API
key, 404 unknown model, 408 body not received in time, 413 body larger than
``max_request_bytes``, 429 more than ``max_pending_requests`` in flight (with
``Retry-After``), 503 engine not running, 504 past the per-request deadline. A rejected
request queues nothing; the limits themselves live in core/server/limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import cadence
from cadence.async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from cadence.lora import LoRARequest
from cadence.output_state import OutputKind
from cadence.server.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES,
    CountTokensRequest,
    install_count_tokens,
)
from cadence.server.beam import BeamServing, check_beam_request
from cadence.server.chat_protocol import ChatCompletionRequest
from cadence.server.chat_shaped import install_chat_shaped_routes
from cadence.server.errors import error_body, error_response
from cadence.server.limits import (
    ApiKeyAuth,
    BodyLimit,
    Deadline,
    DeadlineExceeded,
    ServerLimits,
    check_api_key,
)
from cadence.server.lora_routes import LORA_BODIES, install_lora_routes, model_cards
from cadence.server.metrics import make_registry
from cadence.server.pooling_routes import POOLING_BODIES, install_pooling_routes
from cadence.server.protocol import CompletionRequest, RequestError
from cadence.server.responses import RESPONSES
from cadence.server.serving import OpenAIServing
from cadence.server.tokens import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

# Bodies in other APIs' shapes, run as chat conversations (chat_shaped.py).
CHAT_SHAPED = (RESPONSES, MESSAGES)
# Body fields whose values are JSON objects with keys of the client's choosing.
_MAPPING_FIELDS = frozenset({"logit_bias"})
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           **{e.path: e.body for e in CHAT_SHAPED}, COUNT_TOKENS_PATH: CountTokensRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
           **POOLING_BODIES, **LORA_BODIES}

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, model_name: str, max_request_bytes: int = 4 << 20,
              max_logprobs: int = 20, api_key: str | None = None,
              limits: ServerLimits | None = None, metrics_prefix: str = "vllm",
              tool_call_parser: str | None = None,
              reasoning_parser: str | None = None,
              lora_modules: Sequence[LoRARequest] = (),
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The ASGI app serving ``engine`` under ``model_name``; run it with any ASGI server.

    ``/metrics`` names its metrics ``vllm:*`` (vLLM's names, for existing dashboards) or,
    with ``metrics_prefix="cadence"``, ``cadence:*``.

    With ``api_key``, every route but /health needs ``Authorization: Bearer <api_key>``;
    ``limits`` defaults to ``ServerLimits()`` (docs/server.md, "Limits").
    ``tool_call_parser`` (``server.tool_parsers.TOOL_PARSERS``) serves tool_choice "auto";
    ``reasoning_parser`` (``server.reasoning.REASONING_PARSERS``) splits a reasoning model's
    thinking into ``reasoning_content``. ``lora_modules``: LoRA adapters served under their
    names (the engine must serve adapters); ``allow_runtime_lora_updating`` adds vLLM's
    load/unload routes (lora_routes.py).
    """
    limits = limits or ServerLimits()
    if api_key is not None:
        check_api_key(api_key)  # here, not at the first request, where it would be too late
    serving = OpenAIServing(engine, model_name, max_logprobs, limits, tool_call_parser,
                            reasoning_parser, lora_modules)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(title="cadence", version=cadence.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes,
                       timeout=limits.request_body_timeout)
    if api_key is not None:  # added last, so it runs first: no body is read without the key
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Any:
        problem = engine.check_health()
        if problem is not None:
            return error_response(503, problem)
        # Data-parallel replicas: some may be down while the others serve (200, named).
        problems = engine.replica_problems() if hasattr(engine, "replica_problems") else []
        if any(p is not None for p in problems):
            return {"status": "degraded", "replicas": [
                {"replica": i, "status": "ok" if p is None else p}
                for i, p in enumerate(problems)]}
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": cadence.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": model_cards(serving, engine.max_model_len)}

    if allow_runtime_lora_updating:
        config = _engine_config(engine)
        if config.lora_config is None:
            raise ValueError("runtime LoRA updating needs an engine that serves adapters "
                             "(--enable-lora)")
        install_lora_routes(app, serving, config.model_config.model,
                            config.lora_config.max_lora_rank)

    registry = make_registry(lambda: engine.replica_stats(), model_name,
                             lambda: _backend_name(engine), metrics_prefix)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    beams = BeamServing(serving)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        deadline = Deadline.start(limits.request_timeout)
        if req.use_beam_search:
            return await _unless_disconnected(raw, deadline.run(beams.completion_body(req)))
        check_beam_request(req)
        inputs = serving.completion_inputs(req)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = await serving.submit(inputs, req, kind)
        if req.stream:
            return _event_stream(deadline.stream(serving.completion_events(streams, req)))
        return await _unless_disconnected(
            raw, deadline.run(serving.completion_body(streams, req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        deadline = Deadline.start(limits.request_timeout)
        if req.use_beam_search:
            return await _unless_disconnected(raw, deadline.run(beams.chat_body(req)))
        check_beam_request(req)
        inputs = [serving.chat_input(req)]
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = await serving.submit(inputs, req, kind)
        if req.stream:
            return _event_stream(deadline.stream(serving.chat_events(streams, req)))
        return await _unless_disconnected(raw, deadline.run(serving.chat_body(streams, req)))

    install_chat_shaped_routes(app, CHAT_SHAPED, serving, limits, _unless_disconnected,
                               _event_stream)
    install_count_tokens(app, serving)
    install_pooling_routes(app, engine, serving, limits, _unless_disconnected)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest) -> dict:
        serving.check_model(req.model)
        return tokenize(serving.tokenizer, serving.max_model_len, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest) -> dict:
        serving.check_model(req.model)
        return detokenize(serving.tokenizer, serving.vocab_size, req)

    return app


def _engine_config(engine: Any) -> Any:
    """The engine configuration behind an ``AsyncLLM`` or data-parallel replicas."""
    inner = engine.replicas[0] if hasattr(engine, "replicas") else engine
    return inner.engine.config


async def _unless_disconnected(raw: Request, body: Coroutine[Any, Any, dict]) -> Any:
    """Await ``body`` unless the client hangs up first; then cancel it, which aborts its
    requests in the engine (a streamed response gets the same from Starlette)."""
    work = asyncio.ensure_future(body)

    async def hang_up() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    # Nobody reads this; 499 is what nginx logs for a client that closed the request.
    return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        # Headers are gone once the first event is sent: a later failure can only be
        # reported in the stream itself, as OpenAI does.
        try:
            async for event in events:
                yield event
        except Exception as e:  # reported in the stream (see above)
            # EngineDeadError, DeadlineExceeded, a request that failed; anything else is a
            # fault of ours, logged, and still ends the stream as a stream, not a cut.
            if not isinstance(e, RuntimeError):
                logger.exception("a streamed reply failed")
            timed_out = isinstance(e, DeadlineExceeded)
            body = error_body(504 if timed_out else 500, str(e),
                              code="request_timeout" if timed_out else None)
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _install_error_handlers(app: FastAPI) -> None:
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
        # A field with a union type (``prompt``) fails once per branch, each error's location
        # tagged with the branch ("prompt.str", "prompt.list[int].1"): name the field and
        # the shapes it takes instead of the first branch's complaint.
        branches = [str(x) for x in loc if _is_branch_tag(x)]
        if branches:
            loc = loc[:loc.index(branches[0])]
        field = ".".join(loc) or None
        if branches:
            shapes = []
            for e in errors:
                tags = [str(x) for x in e.get("loc", ()) if _is_branch_tag(str(x))]
                if tags and tags[0] not in shapes:
                    shapes.append(tags[0])
            message = f"{field} has the wrong type or value; it must be one of: " + \
                ", ".join(shapes)
        elif field is None:  # the body as a whole: none, not JSON-typed, or not an object
            message = _body_problem(request.headers.get("content-type", ""), err)
        elif err.get("type") == "extra_forbidden":
            model = _BODIES.get(request.url.path)
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


def _backend_name(engine: AsyncLLM) -> str:
    backend = type(engine.engine.backend)
    return backend.name or backend.__name__


def _is_branch_tag(segment: str) -> bool:
    """True for the union-branch tags pydantic puts in an error's location."""
    return "[" in segment or segment in {"str", "int", "float", "bool"}
