"""Scores from an embedding model (vLLM's ``LLM.score`` and ``/score``; the ``/rerank``
API): each is the cosine similarity of the two texts' embeddings, paired one against N or
N against N; /rerank orders the documents by it; bad bodies are 400s naming the field."""

from __future__ import annotations

import math

import pytest
from engine_helpers import make_llm

from cadence.pooling.scoring import cosine, score_pairs

QUERY = "the small cat sings"
DOCS = ["a dog barks", "the small cat sings", "blue river moon", "cats sing small songs"]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def vectors(model):
    llm = make_llm(model, pooling_type="mean")
    try:
        outs = llm.embed([QUERY, *DOCS], use_tqdm=False)
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        pairwise = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)
        return [o.outputs.embedding for o in outs], scores, pairwise
    finally:
        llm.shutdown()


def _cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) *
                                                       sum(y * y for y in b))


def test_llm_score_is_the_cosine_of_the_embeddings(vectors) -> None:
    vecs, scores, pairwise = vectors
    assert [s.outputs.score for s in scores] == pytest.approx(
        [_cos(vecs[0], v) for v in vecs[1:]], abs=1e-9)
    assert scores[1].outputs.score == pytest.approx(1.0, abs=1e-6)  # the same text
    assert [s.outputs.score for s in pairwise] == pytest.approx(
        [_cos(vecs[1], vecs[3]), _cos(vecs[2], vecs[4])], abs=1e-9)


def test_llm_score_names_its_own_arguments(model) -> None:
    llm = make_llm(model)
    try:
        with pytest.raises(ValueError, match="data_1 and data_2 must hold 1 and N") as e:
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
        assert e.value.param == "data_2"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_pairing_rules() -> None:
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(2, 2) == [(0, 0), (1, 1)]
    for n1, n2, param in ((2, 3, "text_2"), (0, 2, "text_1"), (1, 0, "text_2")):
        with pytest.raises(ValueError) as e:
            score_pairs(n1, n2)
        assert e.value.param == param
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0  # a zero vector scores 0, not NaN


def test_score_and_rerank_over_http(model, vectors) -> None:
    pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
    pytest.importorskip("fastapi", reason="the server tests need the server extra")
    from test_server import serve

    vecs, scores, _ = vectors

    async def body(client, engine):
        out = []
        for path, b in (("/score", {"text_1": QUERY, "text_2": DOCS}),
                        ("/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}),
                        ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
                        ("/v2/rerank", {"query": QUERY, "documents": DOCS,
                                        "return_documents": False})):
            r = await client.post(path, json=b)
            assert r.status_code == 200, r.text
            out.append(r.json())
        bad = []
        for path, b in (("/score", {"text_1": DOCS[:2], "text_2": DOCS}),
                        ("/score", {"text_1": "", "text_2": "x"}),
                        ("/rerank", {"query": "", "documents": DOCS}),
                        ("/rerank", {"query": "q", "documents": []}),
                        ("/rerank", {"query": "q", "documents": DOCS, "top_n": -1}),
                        ("/v1/rerank", {"query": "q", "documents": DOCS, "model": "x"})):
            r = await client.post(path, json=b)
            bad.append((r.status_code, r.json()["error"]["param"]))
        assert not engine.engine.has_unfinished_requests()
        return out, bad

    (one_n, n_n, top2, ranked), bad = serve(model, body, pooling_type="mean")
    assert [d["score"] for d in one_n["data"]] == pytest.approx(
        [s.outputs.score for s in scores], abs=1e-6)
    assert [d["index"] for d in one_n["data"]] == [0, 1, 2, 3]
    assert one_n["usage"]["prompt_tokens"] > 0
    assert [d["score"] for d in n_n["data"]] == pytest.approx(
        [_cos(vecs[1], vecs[3]), _cos(vecs[2], vecs[4])], abs=1e-6)
    want = sorted(range(4), key=lambda i: -scores[i].outputs.score)
    assert [r["index"] for r in ranked["results"]] == want
    assert [r["index"] for r in top2["results"]] == want[:2]
    assert top2["results"][0]["document"] == {"text": DOCS[want[0]]}
    assert "document" not in ranked["results"][0]
    assert bad == [(400, "text_2"), (400, "text_1"), (400, "query"), (400, "documents"),
                   (400, "top_n"), (404, "model")]
