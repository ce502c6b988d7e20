"""Scores from embeddings: the cosine similarity of two texts' vectors, for vLLM's
``LLM.score`` and ``/score`` with an embedding model, and for ``/rerank``. No torch here."""

from __future__ import annotations

import math

from cadence.sampling_params import FieldError

# torch.nn.functional.cosine_similarity's floor on the product of the norms.
_EPS = 1e-8


def score_pairs(n1: int, n2: int) -> list[tuple[int, int]]:
    """Which ``text_1`` goes with which ``text_2`` (vLLM's rule): one against each of N, or
    N pairs in order."""
    if n1 < 1 or n2 < 1:
        raise FieldError("text_1 and text_2 must each hold at least one text",
                         "text_1" if n1 < 1 else "text_2")
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise FieldError(f"text_1 and text_2 must hold 1 and N texts or N and N; got {n1} and "
                     f"{n2}", "text_2")


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / max(norms, _EPS)
