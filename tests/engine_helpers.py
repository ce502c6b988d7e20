"""Helpers for engine-level tests: run an LLM and reduce outputs to comparable tuples,
and spy on the plans the scheduler produces."""

from __future__ import annotations

from cadence import LLM, SamplingParams


def summarize(outputs) -> list:
    """Everything observable about a generate() result, for exact comparisons."""
    rows = []
    for o in outputs:
        for c in o.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [sorted((t, round(lp.logprob, 5), lp.rank) for t, lp in d.items())
                       for d in c.logprobs]
            rows.append((o.request_id, c.index, tuple(c.token_ids), c.text, c.finish_reason,
                         c.stop_reason, lps))
    return rows


class PlanSpy:
    """Records every StepPlan of an engine: (request_id, num_computed, num_new) per entry."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        sched = llm.engine.scheduler
        original = sched.schedule

        def schedule():
            plan = original()
            self.steps.append([(s.request.request_id, s.request.num_computed_tokens,
                                s.num_new_tokens) for s in plan.scheduled])
            return plan

        sched.schedule = schedule

    def times_scheduled(self, request_id: str) -> int:
        return sum(1 for step in self.steps for rid, _, _ in step if rid == request_id)

    def saw_chunked_prefill(self, prompt_lens: dict[str, int]) -> bool:
        return any(0 < new < prompt_lens[rid] - computed and computed < prompt_lens[rid]
                   for step in self.steps for rid, computed, new in step if rid in prompt_lens)


def make_llm(model: str, **kw) -> LLM:
    """An LLM for tests. The CPU backend runs the ``sync`` strategy unless told otherwise:
    the ``process`` default costs seconds of start-up per engine, and tests that are about
    the strategies ask for them by name."""
    kw.setdefault("max_model_len", 256)
    if kw.get("backend", "cpu") == "cpu":
        kw.setdefault("backend_options", {"overlap": "sync"})
    return LLM(model=model, backend=kw.pop("backend", "cpu"), **kw)


def generate(llm: LLM, prompts, params: SamplingParams | list[SamplingParams]):
    return llm.generate(prompts, params, use_tqdm=False)


def greedy_with_logprobs(model: str, prompts: list[list[int]], num_tokens: int,
                         inspect=lambda llm: None, **llm_kw):
    """(tokens, the chosen tokens' logprobs, the backend's runtime info, ``inspect(llm)``)
    of a greedy run of ``prompts`` (token ids) for ``num_tokens`` tokens each, EOS ignored.
    Checks that every KV block is free at the end; shuts the backend down."""
    llm = make_llm(model, **llm_kw)
    try:
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=2)
        outs = generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                             strict=True)] for o in outs]
        seen = inspect(llm)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        return tokens, lps, dict(llm.engine.backend.runtime_info), seen
    finally:
        llm.engine.backend.shutdown()


def greedy_pair(model: str, prompt: list[int], num_tokens: int, **llm_kw
                ) -> tuple[list[int], list[int]]:
    """(cadence's, transformers' cached ``generate``) greedy tokens for one prompt, exactly
    ``num_tokens`` each (EOS ignored), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                       min_new_tokens=num_tokens, do_sample=False)[0, len(prompt):].tolist()
    llm = make_llm(model, **llm_kw)
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    return list(got), want


def assert_same_as(reference, outputs, tol: float = 1e-4) -> None:
    """A split model's outputs against one process's (tensor or pipeline parallel, other
    executors and backends): each request's first sample has the same token ids and the
    same logprob candidates, each logprob within ``tol`` (the ranks' partial sums add in
    another order than one process's)."""
    assert len(outputs) == len(reference)
    for ref, out in zip(reference, outputs, strict=True):
        a, b = ref.outputs[0], out.outputs[0]
        assert b.token_ids == a.token_ids
        for da, db in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert set(da) == set(db)
            assert all(abs(da[t].logprob - db[t].logprob) < tol for t in da)


def lose_a_rank_mid_run(engine, prompts, pid: int, kill: bool, expect: str,
                        warmup_steps: int = 3) -> list:
    """Start ``prompts`` as long requests (ids k0, k1, ...), run ``warmup_steps`` steps,
    then SIGKILL the rank process ``pid`` (``kill``) or SIGSTOP it, and step on: a killed
    rank's group is found at once and every request fails (the group restarts if the
    budget allows); a frozen one is found at the step deadline, and with no restart left
    the engine raises ``EngineFailedError`` matching ``expect``. A stopped rank is resumed
    at the end. Returns the requests' final outputs."""
    import contextlib
    import os
    import signal

    import pytest

    from cadence.faults import EngineFailedError

    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"k{i}", prompt, long)
    for _ in range(warmup_steps):
        engine.step()
    os.kill(pid, signal.SIGKILL if kill else signal.SIGSTOP)
    outputs = []
    try:
        if kill:
            for _ in range(50):
                outputs += engine.step()
                if not engine.has_unfinished_requests():
                    break
        else:
            with pytest.raises(EngineFailedError, match=expect):
                for _ in range(50):
                    engine.step()
            outputs = engine.output_processor.take_ready()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return [o for o in outputs if o.finished]


class StageOutbox:
    """A pipeline stage's communicator that records each send (shape, destination rank)
    instead of making it, for a stage tested alone in one process."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple[int, ...], int]] = []

    def isend(self, x, dst):
        self.sent.append((tuple(x.shape), dst))
        return _Sent()


class StageInbox:
    """A later stage's communicator that records each receive (shape, source rank) and
    hands back zeros of that shape."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple[int, ...], int]] = []

    def recv(self, shape, dtype, src):
        import torch

        self.asked.append((tuple(shape), src))
        return torch.zeros(shape, dtype=dtype)


class _Sent:
    def wait(self) -> None:
        pass


def assert_same_prompt_logprobs(got, want, atol: float = 1e-4) -> None:
    """Each output's prompt logprobs are the reference's: None where it has none, else one
    entry per prompt token (None first), the same token ids in each, logprobs within
    ``atol``."""
    for a, b in zip(got, want, strict=True):
        pa, pb = a.prompt_logprobs, b.prompt_logprobs
        if pb is None:
            assert pa is None
            continue
        assert len(pa) == len(pb) == len(a.prompt_token_ids) and pa[0] is None
        for da, db in zip(pa[1:], pb[1:]):
            assert da.keys() == db.keys()
            assert all(abs(da[t].logprob - db[t].logprob) < atol for t in da)


def assert_same_embeddings(got, want, atol: float = 1e-5) -> None:
    """Each embedding output carries a vector of the reference's length, within ``atol``."""
    for a, b in zip(got, want, strict=True):
        assert a.finished and a.error is None and a.outputs is not None, a
        va, vb = a.outputs.embedding, b.outputs.embedding
        assert len(va) == len(vb)
        worst = max(abs(x - y) for x, y in zip(va, vb))
        assert worst <= atol, f"{a.request_id}: embeddings differ by {worst}"


def register_backend_without_quantization(monkeypatch) -> str:
    """A CPU backend under the name ``noquant`` that runs no quantization method, in the
    process's registry for one test; returns its name. (Every built-in backend runs them.)"""
    from cadence.backends.cpu.backend import CpuBackend
    from cadence.plugins import BackendInfo, get_registry

    class NoQuantBackend(CpuBackend):
        name = "noquant"
        supports_quantization = ()

    backends = dict(get_registry().backends)
    backends["noquant"] = BackendInfo("noquant", NoQuantBackend, "tests", "0")
    monkeypatch.setattr(get_registry(), "backends", backends)
    return "noquant"


def refuse_dense_weights_on_the_device(monkeypatch) -> None:
    """Make the swap of quantized linears (``cadence.quantization.device.swap_quantized``,
    which a device backend runs after the model moved) fail if a linear it swaps still holds
    its dense weight: those must be dropped before the move, so they never take device
    memory."""
    from cadence.quantization import device

    swap = device.swap_quantized

    def checked(model, make):
        left = [m for m in model.modules() if getattr(m, "quantized", None) is not None
                and m.weight.numel()]
        assert not left, f"{len(left)} dense weights moved to the device"
        return swap(model, make)

    monkeypatch.setattr(device, "swap_quantized", checked)


def edit_config_json(folder: str, drop: tuple[str, ...] = (), **changes) -> str:
    """A model folder's config.json with the keys ``drop`` removed and ``changes`` set (a
    value of None writes null); returns ``folder``."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return str(folder)
