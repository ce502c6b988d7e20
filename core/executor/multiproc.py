"""The ``mp`` executor: one worker process per rank on this host (core/executor/worker.py).

The step protocol and its failure rules are ``RankGroup``'s (rank_group.py); here is the
transport: each rank's pipe carries its inputs down and its replies up, a rank whose pipe
closes has died, and a rank's process exit says how.
"""

from __future__ import annotations

import pickle
import select
import signal
import socket
import subprocess
import time
import weakref
from typing import Any

from cadence.backend import Backend, WorkerLostError
from cadence.config import EngineConfig
from cadence.executor.pipes import kill_worker, on_interrupt, read_reply, send, start_worker
from cadence.executor.rank_group import RankGroup, _RankGone

# How long a failed step waits for a rank that is going away to be reaped, so the error
# names the rank that died rather than the peers that failed because of it.
DEATH_GRACE_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_worker(p)


def _exit_reason(proc: subprocess.Popen) -> str:
    code = proc.poll()
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            return f"died (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited (code {code})"


def _reaped_reason(proc: subprocess.Popen) -> str:
    """``_exit_reason`` once a rank whose pipe broke has been reaped: a killed process closes
    its pipes a moment before its exit status can be read, and the error should say it was
    killed, not that its pipe closed."""
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass
    return _exit_reason(proc)


class MultiprocExecutor(RankGroup):
    """``RankGroup`` over one worker process per rank, on this host."""

    executor_name = "mp"

    def __init__(self, backend_cls: type[Backend], config: EngineConfig) -> None:
        super().__init__(backend_cls, config)
        self._procs: list[subprocess.Popen] = []
        self._finalizer = None

    # -- start-up ---------------------------------------------------------------------------

    def load_model(self) -> None:
        self._start_began = time.monotonic()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._procs = []
        self._in_flight = 0
        self._bitmask_failures.clear()
        self._failure = None
        for rank in range(self.world_size):
            spec = self.rank_spec(rank, init_method)
            proc = start_worker("cadence.executor.worker")
            self._procs.append(proc)
            send(proc.stdin, spec)
        # An engine dropped without shutdown() must not leave its ranks behind.
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))

    # -- the transport ----------------------------------------------------------------------

    def _send_all(self, msg: Any) -> None:
        for rank, proc in enumerate(self._procs):
            try:
                send(proc.stdin, msg)
            except OSError:  # a broken pipe: that rank is gone
                raise self._lost(f"rank {rank} of {self.world_size} {_reaped_reason(proc)}; "
                                 "every rank was stopped") from None

    def _wait(self, ranks: list[int], timeout: float | None) -> list[int]:
        fds = {self._procs[r].stdout.fileno(): r for r in ranks}
        ready, _, _ = select.select(list(fds), [], [], timeout)
        return [fds[fd] for fd in ready]

    def _read(self, rank: int) -> Any:
        """The rank's next reply; ``_RankGone`` with the reason when it died."""
        fd = self._procs[rank].stdout.fileno()
        try:
            return read_reply(fd)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise _RankGone(_reaped_reason(self._procs[rank])) from None

    def _kill_ranks(self) -> None:
        _kill_all(self._procs)

    def _dead_rank(self, failed: list[int] | None = None) -> str | None:
        """Why the group lost a step when a rank that died is the cause: a rank that
        replied to a step and then died leaves the ranks that need it (a pipeline's next
        stage, its tensor-parallel peers) failing theirs, and those failures would
        otherwise be what the error names. None when every rank process is alive (a
        real step failure, or a transport without processes to look at, like Ray's)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    after = f" (rank(s) {failed} failed the step without it)" if failed else ""
                    return (f"rank {rank} of {self.world_size} {_exit_reason(proc)}{after}; "
                            "every rank was stopped")
            if not self._procs or time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    # -- health and shutdown ----------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first (for operators and tests)."""
        return [p.pid for p in self._procs]

    def check_health(self, deep: bool = False) -> None:
        procs = list(self._procs)  # read once: the engine thread may be restarting them
        if self._failure is not None:
            raise self._failure_error()
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise WorkerLostError(f"rank {rank} of {self.world_size} "
                                      f"{_exit_reason(proc)}")
        if deep and procs and not self._in_flight:
            with on_interrupt(self._interrupted):
                self._send_all("ping")
                self._gather(self.step_timeout_s)

    def shutdown(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            try:
                if proc.poll() is None:
                    send(proc.stdin, None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_worker(proc)
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self._finalizer is not None:
            self._finalizer.detach()
        self._in_flight = 0
        self._bitmask_failures.clear()

