"""Churn: thousands of requests with random aborts, forced preemption, n > 1, stop strings and
ids, min_tokens, penalties, logprobs, prompt logprobs, prompts that run into max_model_len
and every output kind, through ``LLMEngine`` and ``AsyncLLM``, with and without async scheduling.

Every request must end with exactly one final output, streams must agree with the engine's own
view of each sample, every block must come back, and a request that was not aborted must
produce what it produces alone on a fresh engine (greedy and seeded rows do not depend on the
batch, preemption or async output processing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from cadence import SamplingParams
from cadence.async_engine import AsyncLLM
from cadence.engine import LLMEngine, vocab_size_from_config
from cadence.engine_args import EngineArgs
from cadence.metrics import EngineStats
from cadence.output_processor import OutputProcessor
from cadence.output_state import OutputKind, ParentRequest
from cadence.outputs import RequestOutput
from cadence.request import Request, RequestStatus

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
# 24 blocks of 4 tokens hold a handful of requests: the backlog keeps preempting them. A
# small token budget chunks the longer prompts, so some aborts land mid-prefill.
NUM_KV_BLOCKS = 24
MAX_BATCHED_TOKENS = 24
NUM_REQUESTS = 3000
NUM_ASYNC_REQUESTS = 600
NUM_REFERENCES = 30
# LLMEngine per step strategy: engine arguments, and how many of the specs it runs. Async
# scheduling's runs are shorter: 500 specs already preempt, abort and stop with a step in
# flight dozens of times each (InFlightSpy). "process" is the CPU backend's default
# strategy, its worker filling the placeholders while the engine plans the next step.
MODES = {
    "async_output": ({}, NUM_REQUESTS),
    "sync_output": ({"disable_async_output_proc": True}, NUM_REQUESTS),
    "async_sched": ({"async_scheduling": True}, 1000),
    "async_sched_sync_output": ({"async_scheduling": True, "disable_async_output_proc": True},
                                500),
    "async_sched_process": ({"async_scheduling": True, "overlap": "process"}, 500),
}
STOPS = (["e"], ["th", "中"], [" a"], ["s", "og"], ["ing"])
# When to abort: each request gets one of these (or none).
MOMENTS = ("before_step", "prefill", "decode", "preempted", "finished_pending", "after_final",
           "twice", "random")


def engine_args(model: str, overlap: str = "sync", **kw) -> EngineArgs:
    return EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                      num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                      backend_options={"overlap": overlap, "kv_cache_gb": 0.01}, **kw)


@dataclass(slots=True)
class Spec:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    kind: OutputKind
    moment: str | None  # when to abort it (MOMENTS), None: never
    delay: int  # steps (or outputs, for AsyncLLM) before a "random" or "twice" abort


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    max_tokens = rng.randint(1, 12)
    kw: dict = {"max_tokens": max_tokens, "n": rng.choice((1, 1, 1, 2, 3))}
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        # A few seeds at the top of the range: with n > 1 they wrap around.
        seed = rng.randrange(2**63 - 3, 2**63) if rng.random() < 0.05 else rng.randrange(2**31)
        kw.update(temperature=rng.choice((0.7, 1.0, 1.3)), seed=seed,
                  top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((0, 20)))
    if rng.random() < 0.25:
        kw["stop"] = rng.choice(STOPS)
    if rng.random() < 0.2:
        kw["stop_token_ids"] = rng.sample(range(3, vocab), 40)
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randint(1, max_tokens)
    if rng.random() < 0.25:
        kw["logprobs"] = rng.choice((0, 1, 3))
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.choice((0, 2))
    if rng.random() < 0.1:
        kw["ignore_eos"] = True
    if rng.random() < 0.1:
        # Under async scheduling a two-token word waits on the token still on the device.
        kw["bad_words"] = rng.sample(("the", "cat", "sat on", "a mat", "runs", "quick"), 2)
    if rng.random() < 0.2:
        # Async scheduling appends the token in flight on the device before counting.
        kw.update(presence_penalty=rng.choice((0.0, 0.5, -0.5)),
                  frequency_penalty=rng.choice((0.0, 0.3, 1.0)),
                  repetition_penalty=rng.choice((1.0, 1.2, 0.8)))
    return SamplingParams(**kw)


def make_specs(rng: random.Random, count: int, vocab: int, prefix: str) -> list[Spec]:
    # Shared prompt heads, so prefix-cache hits mix with preemption and aborts.
    heads = [[rng.randrange(3, vocab) for _ in range(8)] for _ in range(4)]
    words = ("the", "cat", "sat", "on", "a", "mat", "café", "dog", "runs", "中文", "quick",
             "night")
    specs = []
    for i in range(count):
        shape, long = rng.random(), False
        if shape < 0.3:
            prompt: str | list[int] = " ".join(rng.choices(words, k=rng.randint(1, 8)))
        else:
            head = rng.choice(heads) if shape < 0.6 else []
            long = rng.random() < 0.1  # runs into max_model_len
            prompt = head + [rng.randrange(3, vocab)
                             for _ in range(rng.randint(30, 52) if long else rng.randint(1, 22))]
        params = random_params(rng, vocab)
        if long:
            params = dataclasses.replace(
                params, max_tokens=None, min_tokens=min(params.min_tokens, 63 - len(prompt)))
        kind = rng.choice((OutputKind.DELTA, OutputKind.DELTA, OutputKind.CUMULATIVE,
                           OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY))
        moment = rng.choice(MOMENTS) if rng.random() < 0.45 else None
        specs.append(Spec(f"{prefix}{i}", prompt, params, kind, moment, rng.randint(0, 12)))
    return specs


class InFlightSpy:
    """Counts what async scheduling did around the step in flight, so a churn that never
    reached those cases cannot pass: placeholders sent (penalty rows apart), tokens that
    commit dropped because their request ended while their step computed (by how it ended),
    and preemptions and aborts of requests in a step in flight (with a placeholder, and mid
    prefill)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.counts: Counter[str] = Counter()
        self.loop = engine._loop
        backend, proc = engine.backend, engine.output_processor
        submit, commit, settle, abort = backend.submit, proc.commit, proc.settle, proc.abort

        def spy_submit(mi):
            self.counts["placeholders"] += len(mi.placeholder_idx)
            self.counts["penalty_placeholders"] += sum(
                1 for s in mi.sampling.output_placeholder_src if s >= 0)
            return submit(mi)

        def spy_commit(scheduled, sample_seq_indices, out, *rest):
            for s in sample_seq_indices:
                req = scheduled[s].request
                if req.is_finished:
                    how = "stop_string" if isinstance(req.stop_reason, str) else \
                        req.status.finish_reason
                    self.counts[f"dropped_{how}"] += 1
            return commit(scheduled, sample_seq_indices, out, *rest)

        def spy_settle(req):  # the scheduler settles a request only to preempt it
            self.count_in_flight("preempted", [req])
            return settle(req)

        def spy_abort(parent_id, abort_child):
            if (p := proc.parents.get(parent_id)) is not None:
                self.count_in_flight("aborted", [c for c in p.children if not c.is_finished])
            return abort(parent_id, abort_child)

        backend.submit, proc.commit, proc.settle, proc.abort = (
            spy_submit, spy_commit, spy_settle, spy_abort)

    def count_in_flight(self, what: str, requests: list[Request]) -> None:
        entries = {id(sr.request): sr for st in self.loop.in_flight for sr in st.plan.scheduled}
        for req in requests:
            if (sr := entries.get(id(req))) is not None:
                self.counts[f"{what}_in_flight"] += 1
                if req.num_output_placeholders:
                    self.counts[f"{what}_with_placeholder"] += 1
                if not sr.samples:
                    self.counts[f"{what}_mid_prefill"] += 1


@dataclass(slots=True)
class SampleView:
    """One sample as the stream showed it, folded over its outputs."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The request's prompt logprobs, as its outputs carried them (on sample 0's view).
    prompt_logprobs: list | None = None


def fold(spec: Spec, outs: list[RequestOutput]) -> list[SampleView]:
    """Check a stream's shape and return what each sample amounts to."""
    n, want_lp = spec.params.n, spec.params.logprobs is not None
    views = [SampleView(logprobs=[] if want_lp else None) for _ in range(n)]
    finals = [k for k, o in enumerate(outs) if o.finished]
    assert finals in ([], [len(outs) - 1]), f"{spec.request_id}: an output after the final one"
    if spec.kind is OutputKind.FINAL_ONLY:
        assert len(outs) <= 1, f"{spec.request_id}: FINAL_ONLY emitted {len(outs)} outputs"
    for out in outs:
        assert out.request_id == spec.request_id
        assert out.error is None, f"{spec.request_id} failed: {out.error}"
        if out.prompt_logprobs is not None:
            assert spec.params.prompt_logprobs is not None, spec.request_id
            assert out.prompt_logprobs[0] is None and all(
                len(d) in (spec.params.prompt_logprobs, spec.params.prompt_logprobs + 1)
                for d in out.prompt_logprobs[1:]), spec.request_id
            if spec.kind is OutputKind.DELTA:
                assert views[0].prompt_logprobs is None, f"{spec.request_id}: sent twice"
            views[0].prompt_logprobs = out.prompt_logprobs
        elif spec.kind is not OutputKind.DELTA:
            # Once complete, every cumulative output carries them.
            assert views[0].prompt_logprobs is None, f"{spec.request_id}: dropped"
        indices = [c.index for c in out.outputs]
        if spec.kind is OutputKind.DELTA:
            # Only the samples with news, in order, each once; a finish is news only once.
            assert indices and indices == sorted(set(indices)), indices
            assert set(indices) <= set(range(n)), indices
        else:
            assert indices == list(range(n))
        for c in out.outputs:
            v = views[c.index]
            assert (c.logprobs is not None) == want_lp
            if want_lp:
                assert len(c.logprobs) == len(c.token_ids)
            if spec.kind is OutputKind.DELTA:
                assert v.finish_reason is None, f"{spec.request_id}: output after its finish"
                assert c.token_ids or c.text or c.finish_reason, f"{spec.request_id}: empty"
                v.token_ids += c.token_ids
                v.text += c.text
                if want_lp:
                    v.logprobs += c.logprobs
            else:
                assert c.token_ids[:len(v.token_ids)] == v.token_ids
                assert c.text.startswith(v.text)
                if v.finish_reason is not None:
                    assert (c.token_ids, c.text, c.finish_reason) == (
                        v.token_ids, v.text, v.finish_reason)
                v.token_ids, v.text = list(c.token_ids), c.text
                if want_lp:
                    v.logprobs = list(c.logprobs)
            assert v.finish_reason is None or c.finish_reason == v.finish_reason
            v.finish_reason, v.stop_reason = c.finish_reason, c.stop_reason
    return views


def check_sample(spec: Spec, v: SampleView, eos: int, prompt_len: int) -> None:
    """What a sample's tokens and finish reason must satisfy, whatever happened to it."""
    sp = spec.params
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {eos})
    toks = v.token_ids
    where = f"{spec.request_id}: {v}"
    assert v.finish_reason in ("stop", "length", "abort"), where
    # Only the last token may be a stop token; below min_tokens none may be sampled at all.
    assert not stops & set(toks[:max(len(toks) - 1, sp.min_tokens)]), where
    if v.logprobs is not None:
        for t, d in zip(toks, v.logprobs):
            assert t in d and len(d) in (sp.logprobs, sp.logprobs + 1), where
    if sp.stop and sp.min_tokens == 0:
        assert not any(s in v.text for s in sp.stop), where
    if v.finish_reason == "length":
        assert len(toks) == sp.max_tokens or prompt_len + len(toks) == MAX_MODEL_LEN, where
    elif v.finish_reason == "stop":
        assert len(toks) >= sp.min_tokens, where
        if isinstance(v.stop_reason, str):
            assert v.stop_reason in sp.stop, where
        elif v.stop_reason is None:
            assert toks[-1] == eos and not sp.ignore_eos, where
        else:
            assert v.stop_reason in sp.stop_token_ids and toks[-1] == v.stop_reason, where


def same_logprobs(a: list | None, b: list | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-5)
                                     for t in x)
        for x, y in zip(a, b))


def check_against_alone(spec: Spec, views: list[SampleView], alone: list[SampleView],
                        aborted: bool) -> None:
    """Not aborted: equal to the alone run. Aborted: every sample a prefix of it."""
    if spec.params.prompt_logprobs is not None:
        got, want = views[0].prompt_logprobs, alone[0].prompt_logprobs
        assert want is not None, f"{spec.request_id}: none alone"
        if got is not None or not aborted:
            assert got is not None and same_logprobs(got[1:], want[1:]), spec.request_id
    for v, ref in zip(views, alone, strict=True):
        where = f"{spec.request_id}: {v} vs alone {ref}"
        if v.finish_reason == "abort":
            assert aborted and v.token_ids == ref.token_ids[:len(v.token_ids)], where
            continue
        assert v.token_ids == ref.token_ids, where
        assert (v.text, v.finish_reason, v.stop_reason) == (
            ref.text, ref.finish_reason, ref.stop_reason), where
        assert same_logprobs(v.logprobs, ref.logprobs), where


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def single_thread():
    """Tiny matmuls on a shared two-core machine: a second torch thread only spin-waits
    (ten times slower here), and every engine of this module must use the same setting."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model(tiny_model_dir, single_thread) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def vocab(model) -> int:
    return vocab_size_from_config(model)


@pytest.fixture(scope="module")
def churn_specs(vocab) -> list[Spec]:
    return make_specs(random.Random(1234), NUM_REQUESTS, vocab, "r")


@pytest.fixture(scope="module")
def alone(model):
    """``alone(spec)``: the spec's samples run by themselves on a fresh engine (cached)."""
    cache: dict[str, list[SampleView]] = {}

    def run(spec: Spec) -> list[SampleView]:
        if spec.request_id not in cache:
            engine = LLMEngine.from_engine_args(engine_args(model))
            engine.add_request(spec.request_id, spec.prompt, spec.params,
                               output_kind=OutputKind.FINAL_ONLY)
            outs = drain(engine)
            engine.shutdown()
            assert outs and outs[-1].finished
            cache[spec.request_id] = fold(Spec(spec.request_id, spec.prompt, spec.params,
                                               OutputKind.FINAL_ONLY, None, 0), outs)
        return cache[spec.request_id]

    return run


class Churn:
    """Drives one engine: adds the specs at random steps, aborts them at their moments."""

    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.children: dict[str, list[Request]] = {}
        self.added_at: dict[str, int] = {}
        # Per request aborted before its final output, per sample: was it still running?
        self.running_at_abort: dict[str, list[bool]] = {}
        self.live: dict[str, Spec] = {}  # added, final output not yet seen
        self.armed: dict[str, Spec] = {}  # abort moment not yet reached
        self.moments_hit: Counter[str] = Counter()
        self.final_due: dict[str, int] = {}  # aborted while live: the step that must end it
        self.step_no = 0

    def abort(self, rid: str, moment: str) -> None:
        if rid in self.live:
            self.running_at_abort.setdefault(rid, [not c.is_finished
                                                   for c in self.children[rid]])
            self.final_due[rid] = self.step_no
        self.moments_hit[moment] += 1
        self.engine.abort_request(rid)

    def add(self, spec: Spec) -> None:
        rid = spec.request_id
        self.engine.add_request(rid, spec.prompt, spec.params, output_kind=spec.kind)
        self.children[rid] = list(self.engine.output_processor.parents[rid].children)
        self.outputs[rid], self.added_at[rid], self.live[rid] = [], self.step_no, spec
        if spec.moment == "before_step":
            self.abort(rid, spec.moment)
        elif spec.moment is not None:
            self.armed[rid] = spec

    def due(self, spec: Spec) -> bool:
        kids = self.children[spec.request_id]
        running = [c for c in kids if c.status == RequestStatus.RUNNING]
        match spec.moment:
            case "prefill":
                return any(c.num_computed_tokens < c.num_prompt_tokens for c in running)
            case "decode":
                return any(c.num_output_tokens for c in running) and self.rng.random() < 0.4
            case "preempted":
                return any(c.status == RequestStatus.PREEMPTED for c in kids)
            case "finished_pending":
                return all(c.is_finished for c in kids)
            case "random" | "twice":
                return self.step_no - self.added_at[spec.request_id] >= spec.delay
        return False

    def abort_due(self) -> None:
        for rid, spec in list(self.armed.items()):
            if rid in self.live and self.due(spec):
                del self.armed[rid]
                self.abort(rid, spec.moment)
                if spec.moment == "twice":
                    self.abort(rid, "twice")
        r = self.rng.random()
        if r < 0.05:
            self.moments_hit["unknown"] += 1
            self.engine.abort_request(f"unknown-{self.step_no}")
        elif r < 0.1 and self.live:
            # A sample's own id is not a request id: this must abort nothing.
            rid = self.rng.choice(list(self.live))
            self.engine.abort_request(f"0_{rid}")

    def take(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            rid = out.request_id
            self.outputs[rid].append(out)
            if out.finished:
                assert self.final_due.get(rid, self.step_no) == self.step_no, \
                    f"{rid}: its final output came later than the step after its abort"
                spec = self.live.pop(rid)
                armed = self.armed.pop(rid, None)
                # "twice" that already fired comes back a third time, after the end.
                if spec.moment == "after_final" or (spec.moment == "twice" and armed is None):
                    self.abort(rid, spec.moment)

    def run(self, specs: list[Spec]) -> None:
        queue = list(reversed(specs))
        while queue or self.engine.has_unfinished_requests():
            for _ in range(self.rng.choice((0, 1, 1, 2))):
                if queue:
                    self.add(queue.pop())
            self.abort_due()
            self.take(self.engine.step())
            self.engine.block_manager.check_invariants()
            self.step_no += 1
            assert self.step_no < 50 * len(specs), "the churn does not finish"


@pytest.mark.parametrize("mode", list(MODES))
def test_churn_through_llm_engine(model, churn_specs, alone, mode):
    kw, count = MODES[mode]
    async_output = not kw.get("disable_async_output_proc", False)
    churn_specs = churn_specs[:count]
    engine = LLMEngine.from_engine_args(engine_args(model, **kw))
    spy = InFlightSpy(engine) if kw.get("async_scheduling") else None
    churn = Churn(engine, random.Random(99))
    churn.run(churn_specs)

    eos = engine.eos_token_id
    finals: list[RequestOutput] = []
    views: dict[str, list[SampleView]] = {}
    for spec in churn_specs:
        rid = spec.request_id
        outs = churn.outputs[rid]
        assert outs and outs[-1].finished, f"{rid}: no final output"
        views[rid] = fold(spec, outs)
        finals.append(outs[-1])
        aborted = churn.running_at_abort.get(rid)
        for v, child, running in zip(views[rid], churn.children[rid],
                                     aborted or [False] * spec.params.n, strict=True):
            check_sample(spec, v, eos, child.num_prompt_tokens)
            # The stream agrees with the engine's own cumulative view of the sample.
            assert (v.token_ids, v.text) == (child.output_token_ids, child.output_text), rid
            if v.finish_reason == "abort":
                assert running, f"{rid}: 'abort' but it was never aborted while running"
            elif running:
                # Aborted while running, it may only have found a stop string in its last
                # unfinalized tokens.
                assert v.finish_reason == "stop" and isinstance(v.stop_reason, str), rid

    # Everything came back.
    bm, sched = engine.block_manager, engine.scheduler
    assert bm.num_free_blocks == engine.num_blocks
    bm.check_invariants()
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert not sched.has_unfinished_requests() and not engine.has_unfinished_requests()
    assert not engine.output_processor.parents

    # The churn did what it is for, and the stats agree with the outputs.
    stats = engine.stats
    reasons = Counter(v.finish_reason for vs in views.values() for v in vs)
    assert stats.finish_reasons == reasons and "error" not in reasons
    assert stats.num_preemptions == sum(o.metrics.num_preemptions for o in finals) > 0
    assert stats.num_requests_added == len(churn_specs)
    # Without async output processing a finished request's final output leaves in the same
    # step, so there is no moment between its finish and its final output.
    moments = set(MOMENTS) - ({"finished_pending"} if not async_output else set())
    assert set(churn.moments_hit) == moments | {"unknown"}, churn.moments_hit
    samples = [v for vs in views.values() for v in vs]
    assert any(isinstance(v.stop_reason, str) for v in samples)
    assert any(isinstance(v.stop_reason, int) for v in samples)
    assert reasons["abort"] > 0 and reasons["length"] > 0
    assert any(v.finish_reason == "length" and c.num_tokens == MAX_MODEL_LEN
               for rid, vs in views.items() for v, c in zip(vs, churn.children[rid]))
    # Tokens dropped at commit count nowhere: usage and token times hold the shown ones.
    assert stats.num_generation_tokens == sum(len(v.token_ids) for v in samples)
    assert stats.inter_token_latency.count == sum(max(len(v.token_ids) - 1, 0)
                                                  for v in samples)
    if spy is not None:
        # Each case happened with a step in flight; a length limit costs no extra step.
        c = spy.counts
        assert c["placeholders"] and c["penalty_placeholders"], c
        assert c["preempted_with_placeholder"] and c["preempted_mid_prefill"], c
        assert c["aborted_with_placeholder"] and c["aborted_mid_prefill"], c
        assert c["dropped_stop"] and c["dropped_stop_string"] and c["dropped_abort"], c
        assert "dropped_length" not in c, c

    # Against the alone runs: requests that were never aborted (a third of them preempted on
    # the way), and a few aborted ones, whose samples must be prefixes of the alone run.
    pick = random.Random(5)
    kept = [s for s in churn_specs if s.request_id not in churn.running_at_abort]
    preempted = [s for s in kept if churn.outputs[s.request_id][-1].metrics.num_preemptions]
    aborted = [s for s in churn_specs if s.request_id in churn.running_at_abort]
    checked = {s.request_id: s for s in pick.sample(preempted, NUM_REFERENCES // 3)
               + pick.sample(kept, NUM_REFERENCES) + pick.sample(aborted, 10)}
    for rid, spec in checked.items():
        check_against_alone(spec, views[rid], alone(spec), rid in churn.running_at_abort)
    engine.shutdown()


def async_plan(spec: Spec) -> tuple[str, int]:
    """What a stream does with its request: ("read", _) to the end, ("leave", k) after k
    outputs (0: before reading any), ("abort", k) abort it after k outputs and read on."""
    if spec.moment is None:
        return "read", 0
    if spec.moment in ("decode", "random", "twice"):
        return "abort", 1 + spec.delay % 3
    return "leave", 0 if spec.moment == "before_step" else spec.delay % 4


@pytest.mark.parametrize("mode", ["async_output", "async_sched"])
def test_churn_through_async_llm(model, vocab, alone, mode):
    """Concurrent streams that leave at random points, or abort and read on to the end."""
    specs = make_specs(random.Random(4321), NUM_ASYNC_REQUESTS, vocab, "a")
    kw = {"async_scheduling": True} if mode == "async_sched" else {}
    spies: list[InFlightSpy] = []
    results: dict[str, list[RequestOutput]] = {}
    aborted: set[str] = set()

    async def consume(engine: AsyncLLM, spec: Spec, gate: asyncio.Semaphore) -> None:
        rid = spec.request_id
        plan, k = async_plan(spec)
        async with gate:
            stream = await engine.add_request(spec.prompt, spec.params, rid,
                                              output_kind=spec.kind)
            outs = results[rid] = []
            if plan == "leave" and k == 0:
                stream.abort()
            async for out in stream:
                outs.append(out)
                if plan == "leave" and len(outs) == k:
                    break
                if plan == "abort" and len(outs) == k and not out.finished:
                    aborted.add(rid)
                    await engine.abort(rid)
                    await engine.abort(rid)
                await asyncio.sleep(0)

    async def main() -> AsyncLLM:
        engine = AsyncLLM.from_engine_args(engine_args(model, **kw))
        if kw:  # before the first request: the spy runs on the engine thread from then on
            spies.append(InFlightSpy(engine.engine))
        try:
            gate = asyncio.Semaphore(32)
            await asyncio.gather(*(consume(engine, s, gate) for s in specs))
            # A stream that was left aborts its request after the caller moved on: wait
            # until every sample was counted finished (once each, aborted or not).
            total = sum(s.params.n for s in specs)
            for _ in range(3000):
                if sum(engine.stats().finish_reasons.values()) == total:
                    break
                await asyncio.sleep(0.01)
        finally:
            await engine.shutdown()
        return engine

    engine = asyncio.run(main())
    inner, stats = engine.engine, engine.stats()
    assert sum(stats.finish_reasons.values()) == sum(s.params.n for s in specs)
    assert "error" not in stats.finish_reasons and stats.num_preemptions > 0
    assert stats.finish_reasons["abort"] > 0
    assert inner.block_manager.num_free_blocks == inner.num_blocks
    inner.block_manager.check_invariants()
    assert not inner.has_unfinished_requests() and engine.num_pending_requests == 0

    views, whole = {}, set()
    for spec in specs:
        rid, outs = spec.request_id, results[spec.request_id]
        views[rid] = fold(spec, outs)
        if async_plan(spec)[0] == "leave" and not (outs and outs[-1].finished):
            continue
        assert outs and outs[-1].finished, f"{rid}: no final output"
        whole.add(rid)
        for v in views[rid]:
            check_sample(spec, v, inner.eos_token_id, len(outs[-1].prompt_token_ids))
            assert v.finish_reason != "abort" or rid in aborted, rid
    assert len(whole) > NUM_ASYNC_REQUESTS // 2 and aborted
    for spy in spies:
        c = spy.counts
        assert c["placeholders"] and c["preempted_with_placeholder"], c
        assert c["aborted_with_placeholder"] and c["dropped_stop"] and c["dropped_abort"], c

    pick = random.Random(6)
    kept = [s for s in specs if s.request_id in whole - aborted]
    left = [s for s in specs if s.request_id not in whole - aborted]
    for spec in pick.sample(kept, 10) + pick.sample(left, 6):
        rid = spec.request_id
        if rid in whole:
            check_against_alone(spec, views[rid], alone(spec), rid in aborted)
        else:
            # Left early: what it saw is a prefix of the alone run.
            for v, ref in zip(views[rid], alone(spec), strict=True):
                assert v.token_ids == ref.token_ids[:len(v.token_ids)], rid


def test_a_sibling_preemption_does_not_report_a_sample_finished_early():
    """With async output processing, preempting one sample settles it and emits its
    request's output between the commit that finished a sibling and the finalize that
    delivers the sibling's last token: that output must not call the sibling finished yet
    (a streaming client stops reading a finished sample and would lose the token)."""
    sp = SamplingParams(max_tokens=2, detokenize=False)
    a, b = (Request(f"{i}_p", [5, 6], sp, parent_id="p", index=i) for i in range(2))
    proc = OutputProcessor(None, lambda r: None, EngineStats(), None, MAX_MODEL_LEN)
    proc.add(ParentRequest("p", None, [5, 6], [a, b], OutputKind.DELTA))
    for r, token in ((a, 7), (b, 8)):
        r.output_token_ids.append(token)
        r.output_logprobs.append(None)
    proc.finalize([a, b])
    # The next commit: a reaches max_tokens, b goes on; both wait for the lagging finalize.
    for r, token in ((a, 9), (b, 10)):
        r.output_token_ids.append(token)
        r.output_logprobs.append(None)
    a.status = RequestStatus.FINISHED_LENGTH
    proc.settle(b)  # the next schedule() preempts b
    proc.finalize([a, b])
    outs = proc.take_ready()
    seen = [[(c.index, c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    # The settle's output carries b's token only: a has nothing new and is not finished.
    assert seen == [[(0, [7], None), (1, [8], None)], [(1, [10], None)], [(0, [9], "length")]]
    assert not any(o.finished for o in outs)
