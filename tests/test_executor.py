"""The executors (core/executor/): a rank that cannot start says which and why. TP=2 on
``mp`` against one process, and a rank lost mid-run: tests/test_tensor_parallel.py, on its
shared engines (each start of a group costs seconds)."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm


def test_a_rank_that_cannot_start_says_which_and_why(tiny_model_dir):
    with pytest.raises(ValueError, match=r"rank \d of 2: cpu linear must be one of"):
        make_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                 backend_options={"overlap": "sync", "linear": "bogus"})


def test_a_rank_that_cannot_join_the_group_says_which_and_why():
    """Nobody listens at the rendezvous address: the rank gives up after its timeout."""
    from cadence import distributed
    from cadence.executor.multiproc import _free_port

    address = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 could not join the gloo group at "
                                           rf"{address}: \w+"):
        distributed.init_torch_distributed("gloo", 1, 2, address, join_timeout=0.5)
    assert distributed.tp_size() == 1  # nothing half-installed


class _ScriptedRanks:
    """An ``mp`` executor whose ranks answer from a script (no processes): each rank's
    replies in order, "hang" for none, "gone" for a rank that died."""

    def __new__(cls, script: dict[int, list], step_timeout: float = 0.05):
        from cadence.config import (
            CacheConfig,
            EngineConfig,
            FaultConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
        )
        from cadence.executor.multiproc import MultiprocExecutor, _RankGone

        class Scripted(MultiprocExecutor):
            killed = False

            def _send_all(self, msg):
                pass

            def _wait(self, ranks, timeout):
                ready = [r for r in ranks if script[r] and script[r][0] != "hang"]
                if not ready:  # as select does: nothing came within the timeout
                    import time

                    time.sleep(timeout)
                return ready

            def _read(self, rank):
                reply = script[rank].pop(0)
                if reply == "gone":
                    raise _RankGone("died (killed by SIGKILL)")
                return reply

            def _kill_ranks(self):
                self.killed = True

        class Named:
            name = "cpu"
            supports_async_scheduling = True
            supports_prompt_logprobs = True

        config = EngineConfig(ModelConfig("unused"), CacheConfig(), SchedulerConfig(),
                              fault_config=FaultConfig(step_timeout_s=step_timeout),
                              parallel_config=ParallelConfig(tensor_parallel_size=2))
        executor = Scripted(Named, config)
        executor._in_flight = 1
        return executor


def test_the_group_rules_for_replies(monkeypatch):
    """Which replies fail one step and which lose the group (core/executor/rank_group.py)."""
    from cadence.backend import WorkerLostError
    from cadence.executor import rank_group

    monkeypatch.setattr(rank_group, "PEER_GRACE_S", 0.05)
    ok = _ScriptedRanks({0: ["samples"], 1: [None]})
    assert ok.collect() == "samples" and not ok.killed
    alike = _ScriptedRanks({0: [("error", "bad id")], 1: [("error", "bad id")]})
    with pytest.raises(RuntimeError, match="failed on every rank") as info:
        alike.collect()
    assert not isinstance(info.value, WorkerLostError) and not alike.killed
    cases = [({0: ["samples"], 1: [("error", "boom")]},
              r"rank\(s\) \[1\] failed a step the others ran"),
             ({0: ["hang"], 1: [("error", "boom")]},
              r"rank 1 of 2 failed a step while rank\(s\) \[0\] still ran it"),
             ({0: ["hang"], 1: ["hang"]},
              r"rank\(s\) \[0, 1\] of 2 gave no reply within 0.05 s"),
             ({0: ["hang"], 1: ["gone"]}, r"rank 1 of 2 died \(killed by SIGKILL\)")]
    for script, message in cases:
        lost = _ScriptedRanks(script)
        with pytest.raises(WorkerLostError, match=message):
            lost.collect()
        assert lost.killed
        with pytest.raises(WorkerLostError, match=message):
            lost.check_health()  # /health says so until a restart


def test_a_killed_rank_is_named_as_killed_not_as_a_closed_pipe() -> None:
    # A killed process's pipes close a moment before its exit status can be read; the
    # reason is taken once it is reaped.
    import signal
    import subprocess
    import sys

    from cadence.executor import multiproc

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            stdin=subprocess.PIPE)
    try:
        proc.send_signal(signal.SIGKILL)
        assert multiproc._reaped_reason(proc) == "died (killed by SIGKILL)"
    finally:
        proc.kill()
        proc.wait()
