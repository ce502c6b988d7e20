"""Embeddings (cadence/pooling; vLLM's ``LLM.embed``): the pooled final hidden states equal
transformers' for last-token, mean and first-token pooling on several families; they do not
depend on how the prompt runs (chunked, preempted, beside generation requests, prefix-cache
hits, async output processing and scheduling, the worker process); the model folder's
sentence-transformers files choose the pooling; Matryoshka dimensions only where the model
says so; bad input is refused and nothing is left holding KV blocks. The server's endpoint
is in tests/test_server_embeddings.py, every backend's check in the conformance kit."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from engine_helpers import assert_same_embeddings, generate, make_llm

from cadence import PoolingParams, SamplingParams
from cadence.pooling import PoolerConfig, PoolingState, load_pooler_config

PROMPTS = [list(range(5, 45)), [7, 3, 9, 100, 41, 12, 12, 12, 5], [42], list(range(60, 93))]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _inputs(prompts=PROMPTS) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _embed(model: str, params=None, prompts=PROMPTS, **llm_kw):
    llm = make_llm(model, **llm_kw)
    try:
        outs = llm.embed(_inputs(prompts), params, use_tqdm=False)
        eng = llm.engine
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.num_blocks
        return outs
    finally:
        llm.shutdown()


def _hf_hidden(model: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0].double()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama-tied"])
@pytest.mark.parametrize(("pooling", "normalize"),
                         [("last", True), ("mean", False), ("cls", True)])
def test_match_transformers(tiny_model_dir, kind, pooling, normalize) -> None:
    model = tiny_model_dir(kind)
    outs = _embed(model, pooling_type=pooling, pooling_normalize=normalize,
                  max_num_batched_tokens=16)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        h = _hf_hidden(model, prompt)
        ref = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
        if normalize:
            ref = torch.nn.functional.normalize(ref, dim=-1)
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
        assert out.prompt_token_ids == prompt and out.finished and out.error is None
        if normalize:
            assert abs(got.norm().item() - 1.0) < 1e-6


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_way_a_prompt_runs_changes_nothing(model, pooling) -> None:
    want = _embed(model, pooling_type=pooling)
    runs = {
        "chunked": {"max_num_batched_tokens": 8},
        "async output off": {"disable_async_output_proc": True},
        "thread": {"backend_options": {"overlap": "thread"}},
        "async scheduling": {"async_scheduling": True, "backend_options": {"overlap": "process"}},
    }
    for kw in runs.values():
        got = _embed(model, pooling_type=pooling, **kw)
        assert_same_embeddings(got, want, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_preempted_mid_prompt(model, pooling) -> None:
    """A decode that needs a block preempts the embedding request in the middle of its
    chunked prompt; computed again, its spans replace the first ones instead of adding."""
    llm = make_llm(model, num_kv_blocks=8, block_size=8, max_num_batched_tokens=9,
                   max_model_len=64, pooling_type=pooling)
    try:
        eng = llm.engine
        eng.add_request("g", {"prompt_token_ids": list(range(3, 23))},
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        for _ in range(3):
            eng.step()
        eng.add_request("e", _inputs(PROMPTS[:1])[0], PoolingParams())
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert done["e"].metrics.num_preemptions > 0
        assert_same_embeddings([done["e"]], llm.embed(_inputs(PROMPTS[:1]), use_tqdm=False),
                               atol=0.0)
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def test_beside_generation_neither_changes(model) -> None:
    gen = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = make_llm(model, max_num_batched_tokens=24)
    try:
        solo_gen = generate(llm, _inputs(PROMPTS[:2]), gen)
        solo_emb = llm.embed(_inputs(), use_tqdm=False)
        eng = llm.engine
        before = eng.stats.num_generation_tokens
        ttft, stops = sum(eng.stats.time_to_first_token.counts), eng.stats.finish_reasons
        stops_before = stops.get("stop", 0)
        for i, p in enumerate(PROMPTS[:2]):
            eng.add_request(f"g{i}", {"prompt_token_ids": p}, gen)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams())
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == \
            [o.outputs[0].token_ids for o in solo_gen]
        assert_same_embeddings([done[f"e{i}"] for i in range(4)], solo_emb)
        # The embedding requests' internal token is no generated token, and has no time to
        # first token; they finish with "stop" (the generation requests with "length").
        assert eng.stats.num_generation_tokens - before == 24
        assert sum(eng.stats.time_to_first_token.counts) - ttft == 2
        assert eng.stats.finish_reasons.get("stop", 0) - stops_before == 4
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def test_prefix_cache_hits_only_where_pooling_allows(model) -> None:
    """Last-token pooling takes prefix-cache hits (a repeated prompt computes one token);
    mean pooling reads every row, so it computes its prompt in full."""
    prompt = [_inputs(PROMPTS[3:])[0]]
    for pooling, hits in (("last", 32), ("mean", 0)):
        llm = make_llm(model, pooling_type=pooling)
        try:
            first = llm.embed(prompt, use_tqdm=False)
            again = llm.embed(prompt, use_tqdm=False)
            assert first[0].num_cached_tokens == 0
            assert again[0].num_cached_tokens == hits, pooling
            assert_same_embeddings(again, first)
        finally:
            llm.shutdown()


def test_sentence_transformers_files_choose_the_pooling(model, tmp_path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(model, folder)
    assert load_pooler_config(str(folder)) == PoolerConfig("last", True, None)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert load_pooler_config(str(folder)) == PoolerConfig("mean", False, None)
    # The command line wins over the files.
    assert load_pooler_config(str(folder), "cls", True) == PoolerConfig("cls", True, None)
    got = _embed(str(folder), prompts=PROMPTS[:2])
    want = _embed(model, PoolingParams(normalize=False), prompts=PROMPTS[:2],
                  pooling_type="mean")
    assert_same_embeddings(got, want, atol=0.0)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_pooler_config(str(folder))
    assert load_pooler_config(str(folder), "last").pooling_type == "last"
    # A module after the pooling that cadence does not apply: embeddings are refused.
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True}))
    assert load_pooler_config(str(folder)).unsupported_modules == ("Dense",)
    with pytest.raises(ValueError, match=r"modules \['Dense'\]"):
        _embed(str(folder), prompts=PROMPTS[:1])


def test_matryoshka_dimensions(model, tmp_path) -> None:
    with pytest.raises(ValueError, match="Matryoshka") as e:
        _embed(model, PoolingParams(dimensions=16))
    assert e.value.param == "dimensions"
    folder = tmp_path / "mrl"
    shutil.copytree(model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    full = _embed(str(folder), PoolingParams(normalize=False), prompts=PROMPTS[:1])
    cut = _embed(str(folder), PoolingParams(dimensions=16), prompts=PROMPTS[:1])
    head = full[0].outputs.embedding[:16]
    norm = math.sqrt(sum(v * v for v in head))
    assert cut[0].outputs.hidden_size == 16
    assert max(abs(a - b / norm) for a, b in zip(cut[0].outputs.embedding, head)) < 1e-6
    with pytest.raises(ValueError, match=r"one of \[16, 32\]"):
        _embed(str(folder), PoolingParams(dimensions=20), prompts=PROMPTS[:1])


def test_bad_input_is_refused_and_nothing_leaks(model) -> None:
    llm = make_llm(model, max_model_len=64)
    try:
        eng = llm.engine
        cases = [
            ({"prompt_token_ids": list(range(64))}, PoolingParams(), "prompt", "fewer than"),
            ({"prompt_token_ids": []}, PoolingParams(), "prompt", "empty"),
            ({"prompt_token_ids": [10**6]}, PoolingParams(), "prompt", "must be in"),
        ]
        for prompt, params, param, words in cases:
            with pytest.raises(ValueError, match=words) as e:
                eng.add_request("bad", prompt, params)
            assert e.value.param == param
        for kw, param in (({"dimensions": 0}, "dimensions"), ({"normalize": 1}, "normalize"),
                          ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens")):
            with pytest.raises(ValueError, match=param) as e:
                PoolingParams(**kw)
            assert e.value.param == param
        with pytest.raises(ValueError, match="pooling_params must be PoolingParams"):
            llm.embed("x", SamplingParams(), use_tqdm=False)
        # A long prompt is embedded by its last tokens when asked.
        (out,) = llm.embed(_inputs([list(range(100))]), use_tqdm=False,
                           truncate_prompt_tokens=20)
        assert out.prompt_token_ids == list(range(80, 100))
        eng.backend.supports_pooling = False
        eng.requests.pooling.supported = False
        with pytest.raises(ValueError, match="embeddings are not supported") as e:
            eng.add_request("r", "the cat", PoolingParams())
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def test_abort_before_the_prompt_is_computed(model) -> None:
    llm = make_llm(model, max_num_batched_tokens=8)
    try:
        eng = llm.engine
        eng.add_request("e", {"prompt_token_ids": PROMPTS[0]}, PoolingParams())
        eng.step()
        eng.abort_request("e")
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        outs += eng.step()
        (out,) = [o for o in outs if o.request_id == "e"]
        assert out.finished and out.outputs is None
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def test_state_replaces_spans_computed_again() -> None:
    st = PoolingState.create(PoolerConfig("mean", False), None, None, 6)
    assert st.wanted(0, 4) == (0, 4) and st.wanted(4, 7) == (4, 2) and st.wanted(6, 7) is None
    st.add(0, 4, [4.0, 8.0])
    assert not st.is_complete
    st.add(0, 2, [2.0, 2.0])  # preempted: computed again from the start, chunked otherwise
    st.add(2, 4, [4.0, 4.0])
    assert st.is_complete and st.embedding() == [1.0, 1.0]
    last = PoolingState.create(PoolerConfig("last"), None, 1, 5)
    assert last.wanted(0, 4) is None and last.wanted(4, 5) == (4, 1)
    last.add(4, 1, [3.0, 4.0])
    assert last.embedding() == [1.0]


def test_async_llm_encode(model) -> None:
    import asyncio

    from cadence import AsyncLLM

    engine = make_llm(model).engine
    llm = AsyncLLM(engine)

    async def run():
        outs = [o async for o in llm.encode({"prompt_token_ids": PROMPTS[1]})]
        await llm.shutdown()
        return outs

    (out,) = asyncio.run(run())
    assert out.metrics.first_token_time is None
    (want,) = _embed(model, prompts=PROMPTS[1:2])
    assert_same_embeddings([out], [want], atol=0.0)


def test_a_base_model_without_head_embeds_and_refuses_generation(model, tmp_path) -> None:
    """``LlamaModel`` saved alone (the layout of e5-mistral or gte-Qwen2: weights named
    ``layers.0...`` without ``model.``, no ``lm_head``) loads, embeds as transformers does,
    and refuses generation with an error that says why."""
    from transformers import AutoModel

    folder = tmp_path / "base"
    base = AutoModel.from_pretrained(model, dtype=torch.float32)
    base.save_pretrained(str(folder))
    shutil.copy(f"{model}/tokenizer.json", folder)
    shutil.copy(f"{model}/tokenizer_config.json", folder)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        names = list(st.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaModel"]
    got = _embed(str(folder), pooling_type="mean", pooling_normalize=False)
    want = _embed(model, pooling_type="mean", pooling_normalize=False)
    assert_same_embeddings(got, want, atol=0.0)
    # Tensor parallel: each rank's vocabulary shard of the embeddings stands in for its
    # head shard. Pipeline parallel has no such stand-in on its last stage: refused.
    split = _embed(str(folder), prompts=PROMPTS[:2], tensor_parallel_size=2, num_kv_blocks=64)
    assert_same_embeddings(split, _embed(model, prompts=PROMPTS[:2]), atol=1e-4)
    with pytest.raises(ValueError, match="without an LM head"):
        make_llm(str(folder), pipeline_parallel_size=2)
    llm = make_llm(str(folder))
    try:
        assert llm.engine.config.model_config.has_lm_head is False
        with pytest.raises(ValueError, match="serves embeddings only") as e:
            llm.generate("the cat", SamplingParams(max_tokens=2), use_tqdm=False)
        assert e.value.param == "model"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", [{}, {"async_scheduling": True}])
def test_churn_of_embeddings_beside_generation(model, mode) -> None:
    """Embedding and generation requests mixed, on a cache small enough to preempt and a
    token budget that chunks, with random aborts: every request ends with one final output,
    every embedding not aborted equals its prompt embedded alone, no block stays held."""
    import random

    rng = random.Random(11)
    specs = []
    for i in range(160):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        embed = rng.random() < 0.4
        params = PoolingParams() if embed else SamplingParams(
            temperature=rng.choice((0.0, 0.8)), seed=i, max_tokens=rng.randint(1, 10),
            ignore_eos=True)
        abort_at = rng.randint(0, 6) if rng.random() < 0.25 else None
        specs.append((f"r{i}", prompt, params, abort_at))
    llm = make_llm(model, pooling_type="mean", num_kv_blocks=12, block_size=8,
                   max_num_batched_tokens=24, max_model_len=64, **mode)
    try:
        eng = llm.engine
        finals, live, step = {}, {}, 0
        pending = list(specs)
        while pending or eng.has_unfinished_requests():
            for _ in range(rng.randint(0, 4)):
                if pending:
                    rid, prompt, params, abort_at = pending.pop(0)
                    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
                    if abort_at is not None:
                        live[rid] = step + abort_at
            for rid, at in list(live.items()):
                if at <= step:
                    eng.abort_request(rid)
                    del live[rid]
            for out in eng.step():
                if out.finished:
                    assert out.request_id not in finals, f"{out.request_id}: two finals"
                    finals[out.request_id] = out
            step += 1
        assert set(finals) == {rid for rid, *_ in specs}
        assert eng.block_manager.num_free_blocks == eng.num_blocks
        assert eng.stats.num_preemptions > 0
        kept = [(rid, p) for rid, p, params, at in specs
                if isinstance(params, PoolingParams) and finals[rid].outputs is not None]
        assert len(kept) > 20
        assert any(finals[rid].metrics.num_preemptions for rid, _ in kept)
        alone = llm.embed([{"prompt_token_ids": p} for _, p in kept], use_tqdm=False)
        assert_same_embeddings([finals[rid] for rid, _ in kept], alone, atol=1e-5)
    finally:
        llm.shutdown()
