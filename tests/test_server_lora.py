"""LoRA adapters on the server: a body's ``model`` picks an adapter of ``--lora-modules``
(the reply equals ``LLM.generate`` with it and names it), ``/v1/models`` lists each with its
parent, an unknown model is a 404 naming those served, and with runtime updating adapters
come and go through vLLM's load/unload routes; a bad adapter is a 400 naming it."""

from __future__ import annotations

import shutil

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from engine_helpers import make_llm
from test_async_engine import all_blocks_free, with_engine
from test_lora import make_adapters

from cadence import LoRARequest, PoolingParams, SamplingParams
from cadence.server.app import build_app
from cadence.server.lora_routes import parse_lora_modules

PROMPT = [5, 9, 11, 40, 2, 7, 7, 30]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> list[LoRARequest]:
    return make_adapters(model, tmp_path_factory.mktemp("server-adapters"))


def serve(model: str, loras: list[LoRARequest], body, runtime: bool = False):
    async def run(engine):
        app = build_app(engine, "tiny", lora_modules=loras,
                        allow_runtime_lora_updating=runtime)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            return await body(client, engine)

    return with_engine(model, run, enable_lora=True, max_loras=2)


def test_model_field_picks_the_adapter(model, adapters) -> None:
    llm = make_llm(model, enable_lora=True, max_loras=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = {lr.lora_name if lr else "tiny": llm.generate(
            [{"prompt_token_ids": PROMPT}], params, use_tqdm=False,
            lora_request=lr)[0].outputs[0].text for lr in [None, *adapters]}
        (vec,) = llm.embed([{"prompt_token_ids": PROMPT}], PoolingParams(), use_tqdm=False,
                           lora_request=adapters[1])
    finally:
        llm.shutdown()
    assert len(set(want.values())) == 3

    async def body(client, engine):
        for name, text in want.items():
            r = await client.post("/v1/completions", json={
                "model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["model"] == name
            assert reply["choices"][0]["text"] == text, name
        r = await client.post("/v1/embeddings", json={"model": "all", "input": PROMPT})
        assert r.status_code == 200, r.text
        got = r.json()["data"][0]["embedding"]
        assert max(abs(a - b) for a, b in zip(got, vec.outputs.embedding)) < 1e-6
        r = await client.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "'tiny', 'qvd', 'all'" in r.json()["error"]["message"]
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == \
            [("tiny", None), ("qvd", "tiny"), ("all", "tiny")]
        assert cards[1]["root"] == adapters[0].lora_path
        metrics = (await client.get("/metrics")).text
        assert 'vllm:lora_requests_info{' in metrics and 'max_lora="2"' in metrics
        assert all_blocks_free(engine)

    serve(model, adapters, body)


def test_adapters_load_and_unload_at_runtime(model, adapters, tmp_path) -> None:
    async def body(client, engine):
        ask = {"model": "late", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        assert (await client.post("/v1/completions", json=ask)).status_code == 404
        load = {"lora_name": "late", "lora_path": adapters[1].lora_path}
        r = await client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        assert (await client.post("/v1/completions", json=ask)).status_code == 200
        r = await client.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 400 and "already loaded" in r.text
        r = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "bad", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        # A malformed folder is a 400 too, never a 500 (the checks read every part of it).
        shutil.copytree(adapters[1].lora_path, tmp_path / "listed")
        (tmp_path / "listed" / "adapter_config.json").write_text("[1]")
        r = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "bad", "lora_path": str(tmp_path / "listed")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        r = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "", "lora_path": adapters[1].lora_path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        assert (await client.post("/v1/completions", json=ask)).status_code == 404
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 404
        assert all_blocks_free(engine)

    serve(model, [], body, runtime=True)


def test_routes_stay_off_without_runtime_updating(model, adapters) -> None:
    async def body(client, engine):
        r = await client.post("/v1/load_lora_adapter", json={
            "lora_name": "x", "lora_path": adapters[0].lora_path})
        assert r.status_code == 404

    serve(model, adapters[:1], body)


def test_an_adapter_may_not_take_the_served_name(model, adapters) -> None:
    async def body(client, engine):
        raise AssertionError("built")

    with pytest.raises(ValueError, match="served model's name 'tiny'"):
        serve(model, [LoRARequest("tiny", 1, adapters[0].lora_path)], body)


def test_lora_modules_flag() -> None:
    got = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}'])
    assert got == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")]
    for bad, message in (("a", "name=path"), ("=/x", "name=path"),
                         ('{"name": "b"}', "'name' and 'path'")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_serve_checks_lora_modules_at_start_up(model, adapters, tmp_path) -> None:
    from cadence.cli.serve import _checked_loras

    assert _checked_loras([adapters[1]], model, 4) == [adapters[1]]
    with pytest.raises(ValueError, match="above --max-lora-rank 4"):
        _checked_loras([adapters[0]], model, 4)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        _checked_loras([LoRARequest("x", 3, str(tmp_path))], model, 16)
