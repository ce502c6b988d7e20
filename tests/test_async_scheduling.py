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
