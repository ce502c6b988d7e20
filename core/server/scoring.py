"""vLLM's ``/score`` and the ``/rerank`` API (Jina's and Cohere's shape) for an embedding
model: each pair's score is the cosine similarity of the two texts' embeddings, computed
through /v1/embeddings' path (embeddings.py).

Decision (docs/server.md): vLLM serves ``/rerank`` from cross-encoder models only; cadence
has no cross-encoder families, and ranks with the embedding model's cosine similarity (a
bi-encoder), which is what an embedding model is trained for.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from cadence.pooling import PoolingParams
from cadence.pooling.scoring import cosine, score_pairs
from cadence.sampling_params import FieldError
from cadence.server.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingServing
from cadence.server.protocol import RequestError


class ScoreRequest(BaseModel):
    """vLLM's /score body: ``text_1`` against each of ``text_2``, or pair by pair."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


class RerankRequest(BaseModel):
    """The rerank body: ``documents`` ranked by their relevance to ``query``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"{field} holds {len(texts)} texts; at most "
                           f"{MAX_EMBEDDING_INPUTS} per request", field)
    if any(not t for t in texts):
        raise RequestError(f"{field} must not hold an empty text", field)
    return texts


class ScoringServing:
    """/score and /rerank over ``EmbeddingServing``."""

    def __init__(self, embeddings: EmbeddingServing) -> None:
        self.embeddings = embeddings

    async def _vectors(self, texts: list[str], fields: list[str], req: ScoreRequest |
                       RerankRequest, lora: Any = None) -> tuple[list[list[float]], int]:
        emb = self.embeddings
        prompts = []
        for text, field in zip(texts, fields, strict=True):
            prompts += emb.prompts([text], req.add_special_tokens, req.truncate_prompt_tokens,
                                   field)
        try:
            params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)
        except FieldError as e:
            raise RequestError(str(e), e.param) from None
        outs = await emb.embed(prompts, params, req.priority, fields[0], lora)
        return [o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs)

    async def score_body(self, req: ScoreRequest, check_model) -> dict:
        lora = check_model(req.model)
        one, two = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
        try:
            pairs = score_pairs(len(one), len(two))
        except FieldError as e:
            raise RequestError(str(e), e.param) from None
        vecs, tokens = await self._vectors(one + two, ["text_1"] * len(one)
                                           + ["text_2"] * len(two), req, lora)
        data = [{"index": k, "object": "score", "score": cosine(vecs[i], vecs[len(one) + j])}
                for k, (i, j) in enumerate(pairs)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()),
                "model": req.model if lora else self.embeddings.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank_body(self, req: RerankRequest, check_model) -> dict:
        lora = check_model(req.model)
        if not req.query:
            raise RequestError("query must not be empty", "query")
        docs = _texts(req.documents, "documents")
        if not docs:
            raise RequestError("documents must hold at least one text", "documents")
        if req.top_n < 0:
            raise RequestError(f"top_n must be >= 0 (0: every document), got {req.top_n}",
                               "top_n")
        vecs, tokens = await self._vectors([req.query, *docs],
                                           ["query"] + ["documents"] * len(docs), req, lora)
        scores = [cosine(vecs[0], v) for v in vecs[1:]]
        order = sorted(range(len(docs)), key=lambda i: (-scores[i], i))
        if req.top_n:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}",
                "model": req.model if lora else self.embeddings.model_name,
                "results": results, "usage": {"total_tokens": tokens}}
