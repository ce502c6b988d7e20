"""Async scheduling on the HPU backend, in emulation (CADENCE_HPU_EMULATE=1, lazy mode):
placeholders filled on the device from the last step's samples at bucket shapes give the
sync engine's outputs (greedy and seeded, penalties, stop strings and ids, max_tokens,
min_tokens, n > 1, logprobs), under preemption and chunked prefill, with no graph compiled
after warmup and every block free at the end.

Everything is compared exactly, logprobs included: the emulation computes a token's
attention with the same bits whichever path and batch it lands in (exact_attention.py),
so a batch that differs (the lagging step, a preemption at another moment) changes
nothing. Its GEMMs are torch's ``F.linear``, whose rows on some CPUs (an AMX Xeon,
docs/backends/cpu.md) take other bits in another batch; there the logprobs are compared
to 1e-4 and everything else still exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import PlanSpy, generate, make_llm, summarize
from test_async_equivalence import CONFIGS, WORDS, _params
from test_async_scheduling import SubmitSpy

from cadence import SamplingParams
from cadence.backend import ModelInput, SamplingMetadata


@pytest.fixture(autouse=True)
def _emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _hpu(model: str, **kw):
    kw.setdefault("max_num_seqs", 8)
    return make_llm(model, backend="hpu", backend_options={"record_events": True}, **kw)


def _workload(model: str) -> list[SamplingParams]:
    """_params() (stop strings, min_tokens, penalties, n = 3, logprobs) plus a stop id."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CADENCE_HPU_EMULATE", "1")
        ref = generate(_hpu(model), [WORDS[0]], SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    stop_id = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ref[5]])
    return _params() + [stop_id]


def _run(model: str, params, **kw):
    llm = _hpu(model, **kw)
    spy = SubmitSpy(llm.engine) if kw.get("async_scheduling") else None
    plans = PlanSpy(llm)
    outs = generate(llm, WORDS + [WORDS[0]], params)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert eng.stats.num_generation_tokens == sum(len(c.token_ids) for o in outs
                                                  for c in o.outputs)
    return summarize(outs), eng, spy, plans


def _gemm_rows_depend_on_batch(model: str) -> bool:
    """Whether ``F.linear`` (through the row padding every GEMM gets) gives the first rows of
    a batch other bits than the same rows alone, on this model's shapes and this CPU."""
    from cadence.layers.linear import linear

    cfg = json.loads((Path(model) / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    for n, k in ((3 * h, h), (h, h), (2 * i, h), (h, i), (v, h)):
        w, x = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g)
        full = linear(x, w)
        if not all(torch.equal(linear(x[:m], w), full[:m]) for m in (1, 2, 4, 8, 16, 24, 32)):
            return True
    return False


def _assert_same(got: list, want: list, exact_logprobs: bool = True) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if exact_logprobs:
            assert a == b, f"request {i}: async scheduling {a}\n != sync {b}"
            continue
        assert a[:6] == b[:6], f"request {i}: async scheduling {a}\n != sync {b}"
        assert (a[6] is None) == (b[6] is None), f"request {i}"
        for step_a, step_b in zip(a[6] or [], b[6] or [], strict=True):
            assert [(t, r) for t, _, r in step_a] == [(t, r) for t, _, r in step_b], i
            assert all(abs(x - y) <= 1e-4 for (_, x, _), (_, y, _) in zip(step_a, step_b))


@pytest.mark.parametrize("config", ["preemption", "chunked"])
def test_hpu_async_scheduling_equals_sync(model, config) -> None:
    params = _workload(model)
    want, _, _, _ = _run(model, params, disable_async_output_proc=True, **CONFIGS[config])
    got, eng, spy, plans = _run(model, params, async_scheduling=True, **CONFIGS[config])
    _assert_same(got, want, exact_logprobs=not _gemm_rows_depend_on_batch(model))
    assert spy.num_placeholders > 0 and spy.num_penalty_placeholders > 0
    assert {row[4] for row in got} >= {"stop", "length"}
    assert any(isinstance(row[5], int) for row in got), "no stop id was hit"
    if config == "preemption":
        assert eng.stats.num_preemptions > 0
    else:
        lens = {str(i): len(eng.tokenizer.encode(p)) for i, p in enumerate(WORDS)}
        assert plans.saw_chunked_prefill(lens)
    backend = eng.backend
    # The fill and the kept samples are warmed up with every bucket.
    assert backend.recompiles_after_warmup() == 0
    # A step is queued whole; its samples are read back later, by collect.
    log = [e for e in backend.event_log if e != "to_host"]
    step = ["forward", "mark_step", "sample", "mark_step"]
    assert log == step * (len(log) // len(step))


def _meta(n: int) -> SamplingMetadata:
    return SamplingMetadata([0.0] * n, [0] * n, [1.0] * n, [0.0] * n, [None] * n, [0] * n, True)


def test_placeholders_land_in_the_padded_batch_from_the_kept_rows(monkeypatch) -> None:
    """Decode rows padded to a bucket: each placeholder is replaced by the buffer row that
    holds its sample; after a failed step nothing is filled."""
    import torch

    from cadence.backends.hpu import buckets as bk
    from cadence.backends.hpu.device import make_device
    from cadence.backends.hpu.feedback import SampledIds

    cfg = bk.BucketConfig((1, 4), (8,), (2, 4), (1, 2), 4, 64, 64)
    fb = SampledIds(cfg, make_device(lazy=True), 4)
    # The previous step: a decode part of 2 rows (bucket 2) and a prefill part of 1 row.
    parts = [bk_part("decode", [7, 8], [1, 0]), bk_part("prefill", [9, 0, 0, 0], [2])]
    fb.keep(parts)
    assert fb.rows == [1, 0, 4] and fb.buf[:5].tolist() == [7, 8, 0, 0, 9]
    fb.begin()
    # This step: three decodes; rows 0 and 2 carry placeholders from sampled rows 2 and 0.
    mi = ModelInput([-1, 5, -1], [3, 4, 5], [0, 1, 2], [1, 1, 1], [4, 5, 6], [[0], [0], [1]],
                    3, [0, 1, 2], _meta(3), placeholder_idx=[0, 2], placeholder_src=[2, 0])
    shape = bk.bucket_for(cfg, mi, range(3), "decode")
    batch = bk.pad_batch(mi, range(3), shape, 9, 4)
    fill = fb.fill_for(mi, range(3), batch)
    ids = torch.tensor(batch.input_ids)
    assert fb.apply(ids, fill).tolist() == [9, 5, 8, 0]
    fb.begin()  # a step that failed before it kept its samples
    with pytest.raises(RuntimeError, match="stale"):
        fb.fill_for(mi, range(3), batch)


def bk_part(kind: str, token_ids: list[int], rows: list[int]):
    import torch

    from cadence.backends.hpu import buckets as bk
    from cadence.backends.hpu.sampling import Part
    from cadence.layers.sampler import DeviceSample

    shape = bk.BucketShape(kind, len(token_ids), 1 if kind == "decode" else 8, 1)
    batch = bk.PaddedBatch(shape, len(rows), [], [], [], [], [], [])
    return Part(batch, rows + [None] * (len(token_ids) - len(rows)),
                 DeviceSample(torch.tensor(token_ids)))


def test_a_step_after_a_failed_collect_fails_too(model) -> None:
    """collect of a step planned on samples that never arrived raises, and the engine re-runs
    both through execute: outputs unchanged."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = summarize(generate(_hpu(model), WORDS[:3], params))
    llm = _hpu(model, async_scheduling=True)
    backend = llm.engine.backend
    to_host, calls = backend.to_host, [0]

    def flaky(parts):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a one-off failure reading the samples")
        return to_host(parts)

    backend.to_host = flaky
    assert summarize(generate(llm, WORDS[:3], params)) == want
    assert calls[0] > 3
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def _recording(call, failures: list):
    def spy(*args):
        try:
            return call(*args)
        except Exception as e:
            failures.append(e)
            raise
    return spy


def test_bucket_ranges_narrower_than_the_batch(model) -> None:
    """Batches past the largest bucket pad to a multiple of it (compiled at run time): the
    buffer of kept samples must hold them too."""
    narrow = {"prompt_bs": "1:1:2", "prompt_seq": "16:16:32", "decode_blocks": "2:2:4",
              "decode_bs": "1:1:2", "record_events": True}
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True,
                            repetition_penalty=1.2)
    outs = {}
    for on in (False, True):
        llm = make_llm(model, backend="hpu", max_num_seqs=8, backend_options=narrow,
                       async_scheduling=on, disable_async_output_proc=not on)
        backend, failures = llm.engine.backend, []
        for name in ("submit", "execute"):
            setattr(backend, name, _recording(getattr(backend, name), failures))
        outs[on] = [r[:6] for r in summarize(generate(llm, WORDS, params))]
        # The engine re-runs failed steps in smaller groups, which would hide a failure.
        assert not failures
        assert any(p.batch_size > 2 for p in backend._unwarmed_seen)
    assert outs[True] == outs[False]
