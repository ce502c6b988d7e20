"""Pipeline parallel on the CPU (gloo, two stage processes): the same greedy tokens and
logprobs as one process, micro-batches really in flight side by side, async output on ==
off, preemption and chunked prefill across micro-batches, a stage lost mid-run, and the
refusals (docs/distributed.md).

Starting two stages costs seconds, so one engine per architecture serves every check."""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_helpers import (
    assert_same_as,
    assert_same_embeddings,
    assert_same_prompt_logprobs,
    generate,
    lose_a_rank_mid_run,
    make_llm,
    summarize,
)

from cadence import PoolingParams, SamplingParams
from cadence.config import ParallelConfig

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings",
           "hello", "a b c d e f g", "twelve drummers drumming and eleven pipers",
           "zebra"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
# One request each: greedy, seeded, a stop string, n > 1, a stop id with a penalty, one token.
MIXED = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=8),
         SamplingParams(temperature=0.0, max_tokens=12, stop=["e"]),
         SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=2),
         SamplingParams(temperature=0.7, seed=11, max_tokens=9, stop_token_ids=[40],
                        repetition_penalty=1.3),
         SamplingParams(temperature=0.0, max_tokens=1)]
# qwen2: q/k/v biases, untied head, F.linear; llama-tied: the last stage loads the head
# from the embeddings' weight (which only the first stage holds), packed GEMMs.
CASES = {"qwen2": {"overlap": "sync", "linear": "torch"},
         "llama-tied": {"overlap": "sync", "linear": "packed"}}


@pytest.fixture(scope="module", params=sorted(CASES))
def pp_pair(request, tiny_model_dir):
    """(the model folder, one-process reference outputs, a PP=2 LLM) for one architecture."""
    model = tiny_model_dir(request.param)
    single = make_llm(model, num_kv_blocks=64, backend_options=CASES[request.param])
    reference = generate(single, PROMPTS, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, pipeline_parallel_size=2,
                   backend_options=CASES[request.param])
    yield model, reference, llm
    llm.shutdown()


def _watch_micro_batches(engine) -> dict:
    """Record, at each submit, how many micro-batches were in flight and the most chunks of
    one request among them, and check that no request is planned while the token it waits
    for is in flight (only a prompt's non-final chunks may follow each other)."""
    seen = {"most": 0, "submits": 0, "chunks_of_one": 0}
    scheduler, hold, release = engine.scheduler, engine.scheduler.hold, engine.scheduler.release
    sampling: set[str] = set()  # requests whose token is in flight
    chunks: dict[str, int] = {}

    def checked_hold(plan):
        ids = {sr.request.request_id for sr in plan.scheduled}
        assert not ids & sampling, "a request planned before its token came back"
        sampling.update(sr.request.request_id for sr in plan.scheduled if sr.samples)
        for rid in ids:
            chunks[rid] = chunks.get(rid, 0) + 1
            seen["chunks_of_one"] = max(seen["chunks_of_one"], chunks[rid])
        seen["submits"] += 1
        seen["most"] = max(seen["most"], len(engine._loop.in_flight))
        hold(plan)

    def checked_release(plan):
        for sr in plan.scheduled:
            rid = sr.request.request_id
            sampling.discard(rid)
            chunks[rid] -= 1
        release(plan)

    scheduler.hold = checked_hold
    scheduler.release = checked_release
    return seen


def test_pp2_matches_one_process_with_two_micro_batches_in_flight(pp_pair):
    _, reference, llm = pp_pair
    engine = llm.engine
    info = engine.backend.env_info()
    assert info["executor"] == "mp" and info["pipeline_parallel_size"] == "2"
    assert len(engine.backend.worker_pids) == 2
    seen = _watch_micro_batches(engine)
    try:
        outputs = generate(llm, PROMPTS, GREEDY)
    finally:
        del engine.scheduler.hold, engine.scheduler.release  # back to the class's methods
    assert_same_as(reference, outputs)
    # Six requests over two stages: two micro-batches of three each side by side.
    assert seen["most"] == 2
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert not engine.scheduler.in_flight


def test_every_step_makes_progress_with_fewer_requests_than_stages(pp_pair):
    """One request on two stages: a step that can plan nothing (its request is in flight)
    commits the micro-batch and plans again, so every step either submits work or returns
    outputs. AsyncLLM reads a step that does neither as a stall and waits for a command
    (up to a second) before stepping again."""
    _, reference, llm = pp_pair
    engine = llm.engine
    engine.add_request("one", PROMPTS[0], GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        steps = engine.stats.num_steps
        outputs = engine.step()
        assert engine.stats.num_steps > steps or outputs or \
            not engine.has_unfinished_requests()
        tokens += [o.outputs[0].token_ids for o in outputs if o.finished]
    assert tokens == [reference[0].outputs[0].token_ids]


def test_pp2_async_output_on_equals_off(pp_pair):
    _, _, llm = pp_pair
    params = MIXED
    on = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]  # ids differ
    llm.engine.async_output = False
    try:
        off = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]
    finally:
        llm.engine.async_output = True
    assert on == off
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_pp2_prompt_logprobs_match_one_process(pp_pair):
    """The last stage computes them from its hidden states and they come back with its
    samples."""
    model, _, llm = pp_pair
    ids = [[5, 9, 11, 40, 2, 7, 7, 30], [3, 4], list(range(10, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    single = make_llm(model, num_kv_blocks=64)
    try:
        want = generate(single, [{"prompt_token_ids": p} for p in ids], params)
    finally:
        single.shutdown()
    got = generate(llm, [{"prompt_token_ids": p} for p in ids], params)
    assert all(w.prompt_logprobs is not None for w in want)
    assert_same_prompt_logprobs(got, want)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_pp2_embeddings_match_one_process(pp_pair):
    """The last stage pools its hidden states and the sums come back with its samples."""
    _, _, llm = pp_pair
    ids = [[5, 9, 11, 40, 2, 7, 7, 30], [3, 4], list(range(10, 60))]
    prompts = [{"prompt_token_ids": p} for p in ids]
    single = make_llm(llm.engine.config.model_config.model, num_kv_blocks=64)
    try:
        want = single.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    finally:
        single.shutdown()
    got = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert_same_embeddings(got, want, atol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_pp2_structured_output(pp_pair):
    """Constrained requests under the pipeline: each micro-batch's bitmask is built from
    matchers its requests' last commit advanced, and the last stage applies it."""
    pytest.importorskip("xgrammar")
    from cadence import StructuredOutputsParams

    _, _, llm = pp_pair
    regex = r"[a-c]{2,5}-\d{1,3}"
    choices = ["yes", "no", "maybe so"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex=regex))
              for i in range(3)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                              structured_outputs=StructuredOutputsParams(choice=choices))
               for i in range(3)]
    outputs = generate(llm, PROMPTS, params)
    for out in outputs[:3]:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    for out in outputs[3:]:
        assert out.outputs[0].text in choices
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_pp2_under_preemption_and_chunked_prefill(tiny_model_dir):
    """A cache too small for every request at once (preemption by recompute) and a token
    budget that chunks the prompts across micro-batches: the same tokens as one process
    with the same limits, every block back at the end. One architecture: the engines are
    built for these limits."""
    model = tiny_model_dir("qwen2")
    long_prompts = [p * 3 for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = {"num_kv_blocks": 12, "max_model_len": 128, "max_num_batched_tokens": 32,
          "backend_options": {"overlap": "sync", "linear": "torch"}}
    single = make_llm(model, **kw)
    try:
        want = [o.outputs[0].token_ids for o in generate(single, long_prompts, params)]
    finally:
        single.shutdown()
    small = make_llm(model, pipeline_parallel_size=2, **kw)
    try:
        got = generate(small, long_prompts, params)
        assert [o.outputs[0].token_ids for o in got] == want
        assert small.engine.stats.num_preemptions > 0
        assert small.engine.block_manager.num_free_blocks == small.engine.num_blocks
    finally:
        small.shutdown()


def test_a_stage_lost_mid_run_fails_every_pending_request(pp_pair, request):
    """Runs last on its engine. qwen2: the last stage is killed, then the group restarts
    and serves the same tokens; llama-tied: the first stage freezes (no reply within the
    step deadline) while the second waits for its activations, and with no restart left
    the engine stops. Every request ends with an error naming the ranks, blocks free."""
    kill = "qwen2" in request.node.callspec.id
    _, reference, llm = pp_pair
    engine = llm.engine
    engine.guard.max_restarts = 1 if kill else 0
    engine.backend.step_timeout_s = 1.0
    pids = engine.backend.worker_pids
    # The first stage is stopped wherever it is: before it sent the collected
    # micro-batch's activations (both stages are named: the last waits for them), after
    # it acknowledged that micro-batch (both: it has not answered the next one), or
    # between the two (only the first). The frozen stage is always named.
    expect = (r"rank 1 of 2 died \(killed by SIGKILL\)" if kill
              else r"rank\(s\) \[(0, 1|0)\] of 2 gave no reply within 1 s")
    failed = lose_a_rank_mid_run(engine, PROMPTS, pids[1 if kill else 0], kill, expect,
                                 warmup_steps=4)
    assert sorted(o.request_id for o in failed) == [f"k{i}" for i in range(len(PROMPTS))]
    assert all(re.search(expect, o.error) for o in failed)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert not engine.scheduler.in_flight
    if kill:  # the next step starts a new group, which serves as the first did
        engine.backend.step_timeout_s = 600.0
        outputs = generate(llm, PROMPTS, GREEDY)
        assert_same_as(reference, outputs)
        assert not set(engine.backend.worker_pids) & set(pids)


def test_a_long_prompt_alone_fills_the_pipeline(tiny_model_dir):
    """One prompt of 100 tokens at 16 a micro-batch: its chunks are in both stages at once
    (each stage runs them in order, so each finds the K/V of those before it), the tokens
    and logprobs are one process's, and blocks all come back. Then with the first
    micro-batch of a 24-token prompt (16 + 8) failing without writing its K/V (its input
    is spoiled, then its collect raises) while the final chunk is in flight: the request
    goes back to where the failed chunk began, the final chunk's token is dropped, not
    kept, and the answer is unchanged."""
    model = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": [(k * i + 3) % 500 + 2 for i in range(n)]}
               for k, n in ((7, 100), (13, 24))]
    kw = {"num_kv_blocks": 40, "max_num_batched_tokens": 16}
    single = make_llm(model, **kw)
    try:
        want = [generate(single, [p], GREEDY) for p in prompts]
    finally:
        single.shutdown()
    llm = make_llm(model, pipeline_parallel_size=2, **kw)
    engine = llm.engine
    try:
        seen = _watch_micro_batches(engine)
        assert_same_as(want[0], generate(llm, [prompts[0]], GREEDY))
        assert seen["chunks_of_one"] == 2 and seen["most"] == 2
        submit, collect = engine.backend.submit, engine.backend.collect
        armed: dict = {}

        def spoiled_submit(mi):
            if not armed.get("spoiled"):
                armed["spoiled"] = True
                mi.input_ids = [5] * len(mi.input_ids)  # K/V of other tokens
            return submit(mi)

        def first_fails():
            out = collect()
            if not armed.get("failed"):
                armed["failed"] = dict(engine.scheduler.in_flight)
                raise RuntimeError("injected: the first micro-batch failed")
            return out

        engine.backend.submit, engine.backend.collect = spoiled_submit, first_fails
        assert_same_as(want[1], generate(llm, [prompts[1]], GREEDY))
        assert list(armed["failed"].values()) == [24]  # both chunks were in flight
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert not engine.scheduler.in_flight
    finally:
        for name in ("hold", "release"):
            engine.scheduler.__dict__.pop(name, None)
        llm.shutdown()


def test_async_scheduling_under_pp_is_the_pipelines_planning(tiny_model_dir):
    """``--async-scheduling`` with PP=2: the pipeline's scheduler and loop plan each
    micro-batch while the others compute, no request in two micro-batches, so no
    placeholders: the same outputs as one process planning with placeholders, over greedy,
    seeded, stop strings, n > 1 and penalties."""
    from cadence.scheduling import PipelineLoop, PipelineScheduler

    model = tiny_model_dir("qwen2")
    params = MIXED
    # Micro-batches change which requests share a GEMM, and F.linear's rows depend on the
    # batch on some CPUs (an AMX Xeon): auto takes a GEMM whose rows do not.
    kw = {"num_kv_blocks": 64, "async_scheduling": True,
          "backend_options": {**CASES["qwen2"], "linear": "auto"}}
    single = make_llm(model, **kw)
    try:
        want = generate(single, PROMPTS, params)
    finally:
        single.shutdown()
    llm = make_llm(model, pipeline_parallel_size=2, **kw)
    try:
        engine = llm.engine
        assert isinstance(engine.scheduler, PipelineScheduler)
        assert isinstance(engine._loop, PipelineLoop)
        seen = _watch_micro_batches(engine)
        try:
            got = generate(llm, PROMPTS, params)
        finally:
            del engine.scheduler.hold, engine.scheduler.release
        assert [row[1:] for row in summarize(got)] == [row[1:] for row in summarize(want)]
        assert_same_as(want[:1], got[:1])
        assert seen["most"] == 2
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


def test_tensor_parallel_inside_pipeline_stages(tiny_model_dir):
    """TP=2 inside each of PP=2 stages (four ranks sharing two cores, ``--cpu-bind none``):
    each stage's ranks reduce over their own group, activations go rank to rank with the
    same TP index, the last stage's first rank answers; the same tokens and logprobs as one
    process with two micro-batches in flight, async output on == off. Then a rank of the
    first stage is killed: its peers fail their steps without it (the other stage's
    receive, its TP partner's all-reduce), and every request fails naming the rank that
    died, not them."""
    model = tiny_model_dir("llama-tied")  # tied head: the last stage's ranks each take
    options = {"overlap": "sync", "linear": "packed"}  # their vocabulary rows of it
    single = make_llm(model, num_kv_blocks=64, backend_options=options)
    reference = generate(single, PROMPTS, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2, pipeline_parallel_size=2,
                   backend_options={**options, "bind": "none"})
    try:
        engine = llm.engine
        info = engine.backend.env_info()
        assert (info["tensor_parallel_size"], info["pipeline_parallel_size"]) == ("2", "2")
        assert engine.backend.output_rank == 2
        pids = engine.backend.worker_pids
        assert len(set(pids)) == 4
        seen = _watch_micro_batches(engine)
        try:
            outputs = generate(llm, PROMPTS, GREEDY)
        finally:
            del engine.scheduler.hold, engine.scheduler.release
        assert_same_as(reference, outputs)
        assert seen["most"] == 2
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6, stop=["e"])
                  for i in range(len(PROMPTS))]
        on = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]
        engine.async_output = False
        off = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]
        engine.async_output = True
        assert on == off
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        engine.guard.max_restarts = 1  # a lost group fails its requests, then restarts
        expect = r"rank 1 of 4 died \(killed by SIGKILL\)"
        failed = lose_a_rank_mid_run(engine, PROMPTS[:3], pids[1], True, expect)
        assert sorted(o.request_id for o in failed) == ["k0", "k1", "k2"]
        assert all(re.search(expect, o.error) for o in failed)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


# -- the split, the scheduler and the refusals (no processes) ---------------------------------

def test_layers_split_into_contiguous_stages():
    from cadence.distributed import pp_layer_range

    assert [pp_layer_range(10, s, 4) for s in range(4)] == \
        [range(3), range(3, 6), range(6, 8), range(8, 10)]
    assert [pp_layer_range(2, s, 2) for s in range(2)] == [range(1), range(1, 2)]
    with pytest.raises(ValueError, match="at least one decoder layer per stage"):
        pp_layer_range(2, 0, 3)


@pytest.mark.parametrize("kind", ["qwen2", "llama-tied"])
def test_a_stage_reads_only_its_own_checkpoint_tensors(kind, tiny_model_dir, checkpoint_reads):
    """Each stage reads its layers, the first the embeddings, the last the final norm and
    the head (a tied one from the embeddings' tensor), and nothing else from disk; every
    tensor is read by some stage, and each loads the same values as one process."""
    from cadence import distributed, model_loader
    from cadence.engine_args import EngineArgs

    model_config = EngineArgs(model=tiny_model_dir(kind)).create_engine_config().model_config
    read = checkpoint_reads
    whole, _ = model_loader.load_model(model_config)
    everything, read[:] = set(read), []
    params = dict(whole.named_parameters(remove_duplicate=False))
    per_stage = []
    try:
        for stage in range(2):
            distributed.set_pipeline_parallel(stage, 2, distributed.Communicator())
            part, _ = model_loader.load_model(model_config)
            per_stage.append(set(read))
            read.clear()
            for name, p in part.named_parameters():
                assert torch.equal(p, params[name]), name
    finally:
        distributed.set_pipeline_parallel(0, 1, None)
    first, last = per_stage
    assert first | last == everything
    # Only a tied head's tensor is read twice: as the embeddings and as the head.
    assert first & last == ({"model.embed_tokens.weight"} if kind == "llama-tied" else set())
    assert not any(n.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for n in first)
    assert not any(n.startswith("model.layers.0.") for n in last)


def test_ranks_are_stage_major_and_each_gets_its_cores():
    from cadence.backends.cpu.placement import rank_cpus

    cfg = ParallelConfig(pipeline_parallel_size=2)
    assert cfg.world_size == 2
    assert [(c.rank, c.pipeline_parallel_rank) for c in map(cfg.with_rank, range(2))] == \
        [(0, 0), (1, 1)]
    assert [rank_cpus(cfg.with_rank(r), [0, 1, 2]) for r in range(2)] == [[0, 1], [2]]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 needs at least 3 CPU"):
        rank_cpus(ParallelConfig(pipeline_parallel_size=3), [0, 1])
    # Two replicas of two stages: each stage its own quarter of the machine.
    eight = list(range(8))
    assert [rank_cpus(ParallelConfig(data_parallel_size=2, data_parallel_rank=d,
                                     pipeline_parallel_size=2, pipeline_parallel_rank=s),
                      eight) for d in range(2) for s in range(2)] == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    # TP=2 inside PP=2: stage-major ranks, one core each; too few cores names the split and
    # the way out.
    both = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [(c.pipeline_parallel_rank, c.tensor_parallel_rank)
            for c in map(both.with_rank, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [rank_cpus(both.with_rank(r), [0, 1, 2, 3]) for r in range(4)] == \
        [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 x --pipeline-parallel-"
                                         r"size 2 needs at least 4 CPU cores.*--cpu-bind none"):
        rank_cpus(both, [0, 1])


def test_bad_pipeline_configs_are_refused(tmp_path, tiny_model_dir):
    import dataclasses

    from cadence.backend import Backend
    from cadence.config import EngineConfig
    from cadence.engine_args import EngineArgs
    from cadence.executor import check_pipeline_parallel_model, create_executor

    with pytest.raises(ValueError, match="use --distributed-executor-backend mp"):
        ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="uniproc")
    with pytest.raises(ValueError, match=r"4 ranks \(--tensor-parallel-size 2 x "
                                         r"--pipeline-parallel-size 2\) need one process"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                       distributed_executor_backend="uniproc")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
    config = EngineArgs(model=tiny_model_dir("llama")).create_engine_config()
    pp2 = ParallelConfig(pipeline_parallel_size=2)
    # Async scheduling under a pipeline is the pipeline's own planning: no placeholders.
    both = EngineConfig(config.model_config, config.cache_config, config.scheduler_config,
                        async_scheduling=True, parallel_config=pp2)
    assert both.async_scheduling and not both.plans_with_placeholders

    class NoStages(Backend):
        name = "nostages"

    with pytest.raises(ValueError, match="'nostages' does not support pipeline parallel"):
        create_executor(NoStages, dataclasses.replace(config, parallel_config=pp2))
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    check_pipeline_parallel_model(str(tmp_path), 2)
    with pytest.raises(ValueError, match="has 2 \\(num_hidden_layers\\)"):
        check_pipeline_parallel_model(str(tmp_path), 3)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2"]}))
    with pytest.raises(ValueError, match=r"GPT2.*LlamaForCausalLM"):
        check_pipeline_parallel_model(str(tmp_path), 2)


def _scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
               prefix_caching: bool = False):
    from cadence.block_manager import BlockManager
    from cadence.config import SchedulerConfig
    from cadence.scheduling import PipelineScheduler

    bm = BlockManager(num_blocks, 4, prefix_caching)
    return PipelineScheduler(SchedulerConfig(max_num_seqs, budget, 64), bm, num_stages=2)


def _chunks(plan) -> list[tuple[str, int, int]]:
    return [(sr.request.request_id, sr.request.num_computed_tokens, sr.num_new_tokens)
            for sr in plan.scheduled]


def test_a_long_prompts_chunks_follow_each_other_through_the_stages():
    """A 40-token prompt alone, 16 tokens a micro-batch: its second chunk is planned while
    the first is in flight, the final one waits for nothing but is itself waited for (its
    token). Blocks enter the prefix cache only as their chunk is committed."""
    s = _scheduler(budget=16, prefix_caching=True)
    bm = s.block_manager
    r = _request("long", 40)
    s.add_request(r)
    plans = []
    for want in (("long", 0, 16), ("long", 16, 16), ("long", 32, 8)):
        plan = s.schedule()
        assert _chunks(plan) == [want]
        s.hold(plan)
        plans.append(plan)
    assert s.schedule().is_empty  # the final chunk's token is in flight
    assert r.num_computed_tokens == 40 and s.in_flight == {"long": 40}
    s.release(plans[0])
    s.update_after_step(plans[0])
    assert r.num_computed_tokens == 40  # counted when submitted, not again
    assert bm.num_cached_blocks == 4  # the first chunk's 4 blocks, not the ones in flight
    s.release(plans[1])
    s.update_after_step(plans[1])
    assert bm.num_cached_blocks == 8
    s.release(plans[2])
    r.output_token_ids.append(5)
    s.update_after_step(plans[2])
    assert bm.num_cached_blocks == 10 and not s.in_flight
    assert _chunks(s.schedule()) == [("long", 40, 1)]  # its first decode


def test_a_failed_chunk_takes_its_request_back_to_where_it_began():
    """The first chunk's micro-batch fails while the second is in flight: the request goes
    back to 0, the second chunk's commit counts nothing (it ran on K/V the first did not
    write), the first runs again on its own and is counted then, and the second is planned
    again from 16."""
    s = _scheduler(budget=16, prefix_caching=True)
    r = _request("long", 40)
    s.add_request(r)
    first, second = s.schedule(), None
    s.hold(first)
    second = s.schedule()
    s.hold(second)
    assert r.num_computed_tokens == 32
    s.roll_back(first)
    s.release(first)
    assert r.num_computed_tokens == 0
    s.release(second)
    s.update_after_step(second)
    assert r.num_computed_tokens == 0 and not s.block_manager.num_cached_blocks
    s.update_after_step(first)  # its rerun alone, committed
    assert r.num_computed_tokens == 16 and s.block_manager.num_cached_blocks == 4
    assert _chunks(s.schedule()) == [("long", 16, 16)]


def _request(rid: str, num_prompt: int = 4):
    from cadence.request import Request

    return Request(request_id=rid, prompt_token_ids=list(range(num_prompt)),
                   sampling_params=SamplingParams(max_tokens=4), eos_token_ids=())


def test_micro_batches_split_the_requests_and_skip_those_in_flight():
    s = _scheduler()
    for i in range(5):
        s.add_request(_request(f"r{i}"))
    a = s.schedule()
    assert [sr.request.request_id for sr in a.scheduled] == ["r0", "r1", "r2"]  # 5 / 2 up
    s.hold(a)
    b = s.schedule()
    assert [sr.request.request_id for sr in b.scheduled] == ["r3", "r4"]
    s.hold(b)
    assert s.schedule().is_empty  # everyone is in flight
    s.release(a)  # committed: each prompt sampled one token
    for sr in a.scheduled:
        sr.request.output_token_ids.append(7)
    s.update_after_step(a)
    again = s.schedule()
    assert [sr.request.request_id for sr in again.scheduled] == ["r0", "r1", "r2"]
    assert all(sr.is_decode for sr in again.scheduled)


def test_preemption_never_takes_a_request_in_flight():
    """Two blocks of 4 tokens: r0 and r1 hold one each. r0's micro-batch is committed and
    r0 must grow while r1's is in flight: r1, the tail, is the victim one batch would take,
    but its blocks are in use on the device. r0 neither takes them nor gives up its own
    place (that would invert FCFS): it waits for r1's commit, and the plan after it
    preempts r1."""
    s = _scheduler(num_blocks=2)
    s.add_request(_request("r0"))
    s.add_request(_request("r1"))
    first = s.schedule()
    assert [sr.request.request_id for sr in first.scheduled] == ["r0"]
    s.hold(first)
    second = s.schedule()
    assert [sr.request.request_id for sr in second.scheduled] == ["r1"]
    s.hold(second)
    # r0's micro-batch is committed (its prompt sampled one token) while r1's is in flight.
    s.release(first)
    first.scheduled[0].request.output_token_ids.append(7)
    s.update_after_step(first)
    waiting = s.schedule()
    assert waiting.is_empty and not waiting.preempted
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    s.release(second)  # now r1's
    second.scheduled[0].request.output_token_ids.append(7)
    s.update_after_step(second)
    plan = s.schedule()  # nothing in flight now: the tail goes, as in one batch
    assert [sr.request.request_id for sr in plan.scheduled] == ["r0"]
    assert [r.request_id for r in plan.preempted] == ["r1"]
