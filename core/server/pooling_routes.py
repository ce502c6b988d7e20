"""The routes an embedding model serves: /v1/embeddings, vLLM's /score and /v1/score, and
/rerank, /v1/rerank and /v2/rerank (embeddings.py, scoring.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from cadence.server.embeddings import EmbeddingRequest, EmbeddingServing
from cadence.server.limits import Deadline, ServerLimits
from cadence.server.scoring import RerankRequest, ScoreRequest, ScoringServing

# Each path's body model, for the error that lists a body's valid fields.
POOLING_BODIES = {"/v1/embeddings": EmbeddingRequest, "/score": ScoreRequest,
                  "/v1/score": ScoreRequest, "/rerank": RerankRequest,
                  "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest}


def install_pooling_routes(app: FastAPI, engine: Any, serving: Any, limits: ServerLimits,
                           unless_disconnected: Callable[..., Any]) -> None:
    """Add the routes; ``unless_disconnected(raw, body)`` cancels a body whose client left
    (app.py), which aborts its requests."""
    embeddings = EmbeddingServing(engine, serving.model_name, serving.tokenizer,
                                  serving.max_model_len)
    scoring = ScoringServing(embeddings)

    def run(raw: Request, body: Any) -> Any:
        return unless_disconnected(raw, Deadline.start(limits.request_timeout).run(body))

    @app.post("/v1/embeddings")
    async def embeddings_route(req: EmbeddingRequest, raw: Request) -> Any:
        return await run(raw, embeddings.body(req, serving.check_model))

    async def score_route(req: ScoreRequest, raw: Request) -> Any:
        return await run(raw, scoring.score_body(req, serving.check_model))

    async def rerank_route(req: RerankRequest, raw: Request) -> Any:
        return await run(raw, scoring.rerank_body(req, serving.check_model))

    for path, body in POOLING_BODIES.items():
        if body is ScoreRequest:
            app.post(path)(score_route)
        elif body is RerankRequest:
            app.post(path)(rerank_route)
