"""Async scheduling (plan step N+1 while step N computes, with placeholders the backend
fills from step N's samples) gives exactly the sync engine's outputs: greedy and seeded,
penalties, stop strings, stop ids, max_tokens, n > 1, under preemption and chunked prefill,
for every CPU strategy; every KV block is free at the end; no discarded token is ever
visible; a backend without the protocol is refused. docs/async_scheduling.md."""

from __future__ import annotations

import pytest
from engine_helpers import PlanSpy, generate, make_llm, summarize
from test_async_equivalence import CONFIGS, WORDS, _params

from cadence import SamplingParams
from cadence.engine import LLMEngine
from cadence.scheduling import check_backend_supports


class SubmitSpy:
    """Counts the steps an engine submitted, and the placeholders they carried."""

    def __init__(self, engine: LLMEngine) -> None:
        self.num_steps = self.num_placeholders = self.num_penalty_placeholders = 0
        submit = engine.backend.submit

        def spy(mi):
            self.num_steps += 1
            self.num_placeholders += len(mi.placeholder_idx)
            self.num_penalty_placeholders += sum(
                1 for s in mi.sampling.output_placeholder_src if s >= 0)
            return submit(mi)

        engine.backend.submit = spy


def _run(model: str, prompts, params, **kw):
    llm = make_llm(model, **kw)
    spy = SubmitSpy(llm.engine) if kw.get("async_scheduling") else None
    plans = PlanSpy(llm)
    outs = generate(llm, prompts, params)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    eng.block_manager.check_invariants()
    assert eng.stats.num_generation_tokens == sum(len(c.token_ids) for o in outs
                                                  for c in o.outputs)
    return summarize(outs), eng, spy, plans


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """The sync engine (no overlap at all) per config: the reference."""
    return {cfg: _run(model, WORDS, _params(), disable_async_output_proc=True, **kw)[0]
            for cfg, kw in CONFIGS.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("async_output", [True, False])
def test_async_scheduling_equals_sync(model, reference, config, async_output):
    got, eng, spy, plans = _run(model, WORDS, _params(), async_scheduling=True,
                                disable_async_output_proc=not async_output, **CONFIGS[config])
    assert got == reference[config]
    # The protocol was really exercised: decodes ran on placeholders, penalties included.
    assert spy.num_placeholders > 0 and spy.num_penalty_placeholders > 0
    if config == "preemption":
        assert eng.stats.num_preemptions > 0
    if config == "chunked":
        lens = {str(i): len(eng.tokenizer.encode(p)) for i, p in enumerate(WORDS)}
        assert plans.saw_chunked_prefill(lens)
    finish = {row[4] for row in got}
    assert "stop" in finish and "length" in finish


@pytest.mark.parametrize("overlap", ["thread", "process"])
def test_async_scheduling_equals_sync_for_every_cpu_strategy(model, reference, overlap):
    got, eng, spy, _ = _run(model, WORDS, _params(), async_scheduling=True,
                            backend_options={"overlap": overlap}, **CONFIGS["preemption"])
    eng.shutdown()
    assert got == reference["preemption"]
    assert spy.num_placeholders > 0 and eng.stats.num_preemptions > 0


def test_stop_strings_and_discarded_steps_leave_no_trace(model):
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = generate(make_llm(model), WORDS, sp)
    llm = make_llm(model, async_scheduling=True)
    plans = PlanSpy(llm)
    for i, o in enumerate(base):
        full = o.outputs[0].text
        stop = full[len(full) // 2: len(full) // 2 + 2] if len(full) > 4 else ""
        if not stop.strip():
            continue
        res = generate(llm, [WORDS[i]], SamplingParams(max_tokens=30, temperature=0.0,
                                                       ignore_eos=True, stop=[stop],
                                                       logprobs=2))[0]
        out = res.outputs[0]
        assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
        n = len(out.token_ids)
        assert list(out.token_ids) == list(o.outputs[0].token_ids[:n])
        assert len(out.logprobs) == n
        # Found by finalize two plans late: planned at most twice more, never shown.
        assert n <= plans.times_scheduled(res.request_id) <= n + 2
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_step_phases_are_timed_once(model):
    """Fixed lengths empty the plan while the last step is in flight, which is then
    committed inside step(): its collect, finalize and commit are timed by themselves, not
    again as drain, so the phases never add up to more than the time spent stepping."""
    import time

    llm = make_llm(model, async_scheduling=True)
    eng = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(str(i), {"prompt_token_ids": list(range(3, 20 + i))}, params)
    plans = PlanSpy(llm)
    collect = eng.backend.collect

    def slow_collect():  # makes counting it twice larger than all the untimed work
        time.sleep(0.05)
        return collect()

    eng.backend.collect = slow_collect
    before = dict(eng.stats.times.phases)
    spent = 0.0
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        spent += time.perf_counter() - t
    timed = sum(v - before.get(k, 0.0) for k, v in eng.stats.times.phases.items())
    assert [] in plans.steps  # the empty plan around a step in flight happened
    assert timed <= spent
    llm.shutdown()


def test_stop_ids_cost_one_planned_step_and_length_none(model):
    prompt = {"prompt_token_ids": list(range(3, 40))}
    ref = generate(make_llm(model), [prompt], SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    target = ref[6]
    first = list(ref).index(target)
    llm = make_llm(model, async_scheduling=True)
    plans = PlanSpy(llm)
    out = generate(llm, [prompt], SamplingParams(max_tokens=20, temperature=0.0,
                                                 stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert list(out.token_ids) == list(ref[:first + 1])
    # The stop id is only known once its step returns: the step planned meanwhile is the
    # one discarded step.
    assert plans.times_scheduled("0") == first + 2
    out = generate(llm, [prompt], SamplingParams(max_tokens=5, temperature=0.0,
                                                 ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and list(out.token_ids) == list(ref[:5])
    # A length limit is known in advance: no step is planned past it.
    assert plans.times_scheduled("1") == 5
    stats = llm.engine.stats
    assert stats.num_generation_tokens == first + 1 + 5
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def _stop_string_at(llm, token_ids: list[int]) -> tuple[int, str]:
    """(k, s): the first token k >= 3 whose text adds a piece s not in the text before it,
    so the stop string s ends a request at token k exactly."""
    tok = llm.engine.tokenizer
    for k in range(3, len(token_ids)):
        before, after = tok.decode(token_ids[:k]), tok.decode(token_ids[:k + 1])
        new = after[len(before):]
        if after.startswith(before) and new.isascii() and new.strip() and new not in before:
            return k, new
    raise AssertionError("no token adds a new piece of text")


@pytest.mark.parametrize("case", ["empty_plan", "failed_submit"])
def test_the_token_after_a_stop_string_is_dropped_at_commit(model, case):
    """The stop string is in token k; token k + 1 is committed right after token k, with no
    step call in between: when k + 1 reaches max_tokens (the plan made while it is in flight
    is empty, so it is committed at once), or when submitting the step after it failed (the
    step before is committed, then that one runs again). Finalize must see token k first:
    k + 1 is dropped at commit, not appended and cut back, so it never reaches the
    inter-token latency or the time per output token, and is not computed again."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = list(generate(make_llm(model), [prompt], greedy)[0].outputs[0].token_ids)
    llm = make_llm(model, async_scheduling=True)
    k, stop = _stop_string_at(llm, ref)
    plans = PlanSpy(llm)
    eng = llm.engine
    commit, submit, execute = eng.output_processor.commit, eng.backend.submit, \
        eng.backend.execute
    dropped, submits, reruns = [], [0], [0]

    def spy_commit(scheduled, sample_seq_indices, out, *rest):
        dropped.extend(scheduled[s].request.request_id for s in sample_seq_indices
                       if scheduled[s].request.is_finished)
        return commit(scheduled, sample_seq_indices, out, *rest)

    def flaky_submit(mi):
        submits[0] += 1
        # Step 1 is the prefill (token 0); step k + 2 samples token k + 1.
        if case == "failed_submit" and submits[0] == k + 2:
            raise RuntimeError("a one-off failure sending the step")
        return submit(mi)

    def spy_execute(*args):
        reruns[0] += 1
        return execute(*args)

    eng.output_processor.commit, eng.backend.submit, eng.backend.execute = (
        spy_commit, flaky_submit, spy_execute)
    max_tokens = k + 2 if case == "empty_plan" else 30
    out = generate(llm, [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert list(out.token_ids) == ref[:k + 1]
    if case == "empty_plan":
        assert [] in plans.steps, "the step in flight was never committed on an empty plan"
        assert dropped == ["0"]
    else:
        assert submits[0] == k + 2 and reruns[0] == 0 and not dropped
    stats = eng.stats
    assert stats.num_generation_tokens == k + 1
    assert stats.inter_token_latency.count == k
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("async_output", [True, False])
def test_streamed_deltas_concatenate_to_the_sync_engine_text(model, async_output):
    """DELTA outputs with stop strings and n = 2 (vLLM #8468, #9017): one final output per
    request, and the deltas add up to the sync engine's text and token ids."""
    from test_streaming import PROMPTS, _stream

    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, stop=["e ", "at", "中"],
                            n=2)
    final = generate(make_llm(model, disable_async_output_proc=True), PROMPTS, params)
    llm = make_llm(model, async_scheduling=True, disable_async_output_proc=not async_output)
    _, deltas, finals = _stream(llm, params)
    assert finals == {f"s{i}": 1 for i in range(len(PROMPTS))}
    for i, out in enumerate(final):
        for c in out.outputs:
            assert "".join(deltas[(f"s{i}", c.index)]) == c.text
    assert any(c.finish_reason == "stop" for o in final for c in o.outputs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_request_reaching_max_model_len_exactly(model):
    llm = make_llm(model, max_model_len=64, async_scheduling=True)
    out = generate(llm, [{"prompt_token_ids": list(range(3, 53))}],
                   SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_abort_with_steps_in_flight(model):
    llm = make_llm(model, async_scheduling=True)
    eng = llm.engine
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2)
    for i, w in enumerate(WORDS[:4]):
        eng.add_request(f"r{i}", w, sp)
    finals = {}
    for k in range(40):
        if k == 3:
            eng.abort_request("r1")
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                assert o.request_id not in finals, "two final outputs"
                finals[o.request_id] = o
    assert set(finals) == {"r0", "r1", "r2", "r3"}
    assert {c.finish_reason for c in finals["r1"].outputs} == {"abort"}
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    ref = generate(make_llm(model, disable_async_output_proc=True), WORDS[:4], sp)
    for i in (0, 2, 3):
        assert summarize([finals[f"r{i}"]])[0][2:] == summarize([ref[i]])[0][2:]


def test_failed_steps_are_rerun_and_isolated(model):
    """A step whose samples cannot be read drops the step planned on them and runs again;
    a request that fails every step it is in ends alone with an error."""
    clean = summarize(generate(make_llm(model), WORDS[:4], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True)))
    llm = make_llm(model, async_scheduling=True)
    eng = llm.engine
    collect, submit, execute, calls = eng.backend.collect, eng.backend.submit, \
        eng.backend.execute, [0]
    reruns = [0]

    def flaky_collect():
        out = collect()
        calls[0] += 1
        if calls[0] in (3, 7):
            raise RuntimeError("a one-off failure reading the samples")
        return out

    def poisoned(mi, *rest):
        reruns[0] += bool(rest)
        if 4242 in mi.sampling.seeds:
            raise RuntimeError("simulated failure on the poisoned request")
        return (submit if not rest else execute)(mi, *rest)

    eng.backend.collect = flaky_collect
    eng.backend.submit = poisoned
    eng.backend.execute = poisoned
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = generate(llm, WORDS[:4] + ["bad"], [greedy] * 4 + [
        SamplingParams(max_tokens=8, seed=4242)])
    assert summarize(outs[:4]) == clean
    assert outs[4].outputs[0].finish_reason == "error"
    assert calls[0] >= 7, "the flaky steps were not reached"
    # Each failed step, and the step planned on it, ran again through execute.
    assert reruns[0] >= 4
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_backends_without_the_protocol_are_refused():
    from types import SimpleNamespace

    class Able:
        name = "able"
        supports_async_scheduling = True

    class Unable:
        name = "unable"

    Registry = SimpleNamespace(backends={"able": SimpleNamespace(cls=Able),
                                         "unable": SimpleNamespace(cls=Unable)})
    check_backend_supports(Able, Registry)
    with pytest.raises(ValueError, match="not supported by backend 'unable'.*support it: able"):
        check_backend_supports(Unable, Registry)


def test_every_built_in_backend_declares_it():
    from cadence.plugins import get_registry

    registry = get_registry()
    for name in ("cpu", "cuda", "hpu"):
        cls = registry.backends[name].cls
        assert cls.supports_async_scheduling, name
        check_backend_supports(cls, registry)


def test_shutdown_collects_the_step_in_flight(model) -> None:
    """Nothing stays submitted past the backend: a step planned ahead is collected (with the
    process strategy, its worker answers it) before the backend shuts down."""
    llm = make_llm(model, async_scheduling=True, backend_options={"overlap": "process"})
    eng = llm.engine
    eng.add_request("r", "the cat", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._loop.has_in_flight
    collect = eng.backend.collect
    collected = []
    eng.backend.collect = lambda: collected.append(1) or collect()
    llm.shutdown()
    assert collected and not eng._loop.has_in_flight
