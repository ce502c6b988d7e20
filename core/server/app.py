"""The OpenAI-compatible HTTP server (FastAPI): the routes (their errors: error_handlers.py).

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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import cadence
from cadence.async_engine import (
    AsyncLLM,
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
from cadence.server.error_handlers import install_error_handlers
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
from cadence.server.protocol import CompletionRequest
from cadence.server.responses import RESPONSES
from cadence.server.serving import OpenAIServing
from cadence.server.tokens import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

# Bodies in other APIs' shapes, run as chat conversations (chat_shaped.py).
CHAT_SHAPED = (RESPONSES, MESSAGES)
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

    With ``api_key``, every route but /health needs ``Authorization: Bearer <api_key>`` (or
    ``x-api-key: <api_key>``, as Anthropic's clients send it);
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
    install_error_handlers(app, _BODIES)

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


def _backend_name(engine: AsyncLLM) -> str:
    backend = type(engine.engine.backend)
    return backend.name or backend.__name__
