"""Ctrl-C in the middle of ``LLM.generate``: the interrupt reaches the caller, the call's
requests end there (no KV block stays held), a worker whose exchange with the engine was cut
short is stopped and restarted, and the next call gives the outputs of a clean engine."""

from __future__ import annotations

import pytest
from engine_helpers import generate, make_llm

# The model, its prompts and each prompt's clean greedy tokens: test_faults.py's.
from test_faults import GREEDY, PROMPTS, _gone, clean, model  # noqa: F401  (fixtures)


def _interrupt_call(obj, name: str, at: int) -> list[int]:
    """Make the ``at``-th call of ``obj.name`` raise KeyboardInterrupt, as a Ctrl-C landing
    in it would; the returned list counts the calls."""
    inner = getattr(obj, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return inner(*args, **kwargs)

    setattr(obj, name, wrapped)
    return calls


def _tokens(llm, outs=None) -> dict[str, list[int]]:
    """Each prompt's greedy tokens (of ``outs``, or of a fresh run)."""
    outs = outs or generate(llm, PROMPTS, GREEDY)
    return {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}


def _check_clean_after(llm, expected: dict[str, list[int]]) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests(), "the interrupted call's requests stayed"
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    outs = generate(llm, PROMPTS, GREEDY)
    assert _tokens(llm, outs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("overlap", ["sync", "thread"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ctrl_c_in_process_aborts_the_call(model, clean, async_scheduling, overlap):  # noqa: F811
    """In-process forward: the call's requests are aborted and the steps in flight (async
    scheduling's next one) dropped; nothing is restarted."""
    llm = make_llm(model, num_kv_blocks=64, async_scheduling=async_scheduling,
                   backend_options={"overlap": overlap})
    try:
        backend = llm.engine.backend
        runner = backend.runner
        calls = _interrupt_call(backend, "execute" if not async_scheduling else "collect", 4)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, PROMPTS, GREEDY)
        assert calls[0] == 4
        assert not llm.engine.guard.restart_pending
        _check_clean_after(llm, clean)
        assert backend.runner is runner, "the backend was restarted"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("at", [3, 4, 6])
def test_requests_an_engine_keeps_past_an_interrupt_finish_as_if_never_interrupted(
        model, clean, at):  # noqa: F811
    """``LLMEngine`` used directly, async scheduling: the caller keeps its requests after
    ``after_interrupt``; the step in flight was dropped, its advance is undone, and every
    request ends with the tokens of a run that was never interrupted."""
    llm = make_llm(model, num_kv_blocks=64, async_scheduling=True)
    try:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        calls = _interrupt_call(engine.backend, "collect", at)
        finals = {}
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except KeyboardInterrupt:
                outs = engine.after_interrupt()
            finals.update({o.request_id: o for o in outs if o.finished})
        assert calls[0] > at
        assert {PROMPTS[int(r)]: list(o.outputs[0].token_ids) for r, o in finals.items()} \
            == {p: list(t) for p, t in clean.items()}
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_between_exchanges_drains_the_workers_without_a_restart(
        model, clean, ranks):  # noqa: F811
    """Async scheduling, the interrupt in the engine's own work (its commit of a step's
    tokens) while the next step computes: the pipes are whole, so the replies of the step
    still in flight are read and dropped (the CPU worker's; each ``mp`` rank's), and the
    same processes serve the next call."""
    options = {"overlap": "process", "kv_cache_gb": 0.1} if ranks == 1 else {"overlap": "sync"}
    llm = make_llm(model, num_kv_blocks=64, async_scheduling=True, backend_options=options,
                   tensor_parallel_size=ranks)
    try:
        backend = llm.engine.backend
        pids = list(backend.worker_pids) if ranks > 1 else [backend.worker_pid]
        reference = clean if ranks == 1 else _tokens(llm)
        _interrupt_call(llm.engine.output_processor, "commit", 3)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, PROMPTS, GREEDY)
        assert llm.engine._loop.in_flight == type(llm.engine._loop.in_flight)()
        assert not llm.engine.guard.restart_pending
        _check_clean_after(llm, reference)
        now = list(backend.worker_pids) if ranks > 1 else [backend.worker_pid]
        assert now == pids, "the workers were restarted"
    finally:
        llm.shutdown()


def test_a_second_ctrl_c_while_steps_are_dropped_restarts_before_the_next_call(
        model, clean):  # noqa: F811
    llm = make_llm(model, num_kv_blocks=64, async_scheduling=True,
                   backend_options={"overlap": "process", "kv_cache_gb": 0.1})
    try:
        backend = llm.engine.backend
        pid = backend.worker_pid
        _interrupt_call(llm.engine.output_processor, "commit", 3)
        _interrupt_call(backend, "discard_in_flight", 1)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, PROMPTS, GREEDY)
        assert llm.engine.guard.restart_pending
        _check_clean_after(llm, clean)
        assert backend.worker_pid != pid and llm.engine.guard.restarts == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ctrl_c_while_the_worker_computes_stops_and_restarts_it(model, clean,  # noqa: F811
                                                                async_scheduling):
    """The ``process`` worker: the interrupt lands while the engine waits for a reply, which
    would be left in the pipe for the next step to read as its own. The worker is stopped at
    once, the restart comes before the next call's requests, and they run clean."""
    llm = make_llm(model, num_kv_blocks=64, async_scheduling=async_scheduling,
                   backend_options={"overlap": "process", "kv_cache_gb": 0.1})
    try:
        backend = llm.engine.backend
        pid = backend.worker_pid
        _interrupt_call(backend._worker, "_recv", 4)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, PROMPTS, GREEDY)
        assert _gone(pid), "the worker that held the interrupted step still runs"
        assert llm.engine.guard.restart_pending, "the stopped worker was not found at once"
        _check_clean_after(llm, clean)
        assert backend.worker_pid != pid
        assert llm.engine.guard.restarts == 0, "an interrupt spent the restart budget"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("where,async_scheduling", [("_send_all", False), ("_wait", False),
                                                    ("_wait", True)])
def test_ctrl_c_while_the_ranks_compute_stops_and_restarts_them(model, where,  # noqa: F811
                                                                async_scheduling):
    """The ``mp`` executor (tensor parallel, two ranks): the same, for every rank, whether
    the interrupt lands while a step goes out or while its replies are awaited."""
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2,
                   async_scheduling=async_scheduling)
    try:
        reference = _tokens(llm)
        backend = llm.engine.backend
        pids = list(backend.worker_pids)
        _interrupt_call(backend, where, 3)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, PROMPTS, GREEDY)
        assert all(_gone(pid) for pid in pids)
        _check_clean_after(llm, reference)
        assert not set(backend.worker_pids) & set(pids)
        assert llm.engine.guard.restarts == 0
    finally:
        llm.shutdown()


def test_the_reason_is_what_the_next_health_check_says(model):  # noqa: F811
    """Between the interrupt and the restart, the backend names why it stopped its worker."""
    from cadence.backend import WorkerLostError

    llm = make_llm(model, num_kv_blocks=64,
                   backend_options={"overlap": "process", "kv_cache_gb": 0.1})
    try:
        worker = llm.engine.backend._worker
        _interrupt_call(worker, "_recv", 2)
        with pytest.raises(KeyboardInterrupt):
            llm.engine.add_request("x", PROMPTS[0], GREEDY)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        with pytest.raises(WorkerLostError, match=r"a step was interrupted \(KeyboardInterrupt\)"
                                                  r" while the CPU forward worker ran it"):
            worker.check_alive()
    finally:
        llm.shutdown()


def test_interrupted_restarts_are_not_spent_and_real_losses_stay_counted():
    """An interrupt's restart is free; one planned for a real loss stays counted when an
    interrupt follows it; a restart that an interrupt cut short is tried again and counted
    once."""
    from cadence.backend import WorkerLostError
    from cadence.faults import StepGuard

    class Backend:
        fail_next = False

        def restart(self):
            if self.fail_next:
                self.fail_next = False
                raise KeyboardInterrupt
            return 8

    backend, reset = Backend(), []
    guard = StepGuard(backend, 1, None, None, lambda message: None, reset.append)
    guard.recover(WorkerLostError("interrupted", interrupted=True))
    guard.repair()
    assert (guard.restarts, guard.restart_pending, reset) == (0, False, [8])
    guard.recover(WorkerLostError("died"))
    guard.recover(WorkerLostError("interrupted", interrupted=True))
    backend.fail_next = True
    with pytest.raises(KeyboardInterrupt):
        guard.repair()
    assert (guard.restarts, guard.restart_pending) == (0, True)
    guard.repair()
    assert (guard.restarts, guard.restart_pending, reset) == (1, False, [8, 8])
    # The budget (1) is spent: a real loss now ends the engine, an interrupt does not.
    guard.recover(WorkerLostError("interrupted", interrupted=True))
    guard.repair()
    from cadence.faults import EngineFailedError

    with pytest.raises(EngineFailedError, match="1 restarts used of max_worker_restarts=1"):
        guard.recover(WorkerLostError("died"))


def test_a_restart_that_keeps_failing_ends_the_engine_at_the_budget():
    """Even one owed to an interrupt: a failed restart is a failure, counted, and past the
    budget the engine stops retrying it instead of trying at every step."""
    from cadence.backend import WorkerLostError
    from cadence.faults import EngineFailedError, StepGuard

    class Backend:
        def restart(self):
            raise RuntimeError("the device is gone")

    guard = StepGuard(Backend(), 2, None, None, lambda message: None, lambda n: None)
    guard.recover(WorkerLostError("interrupted", interrupted=True))
    with pytest.raises(RuntimeError, match="the device is gone"):
        guard.repair()
    assert (guard.restarts, guard.restart_pending) == (1, True)
    with pytest.raises(EngineFailedError, match="restarting the backend failed .* 2 restarts "
                                                "used of max_worker_restarts=2"):
        guard.repair()
    assert not guard.restart_pending
