"""The ``ray`` executor: each rank is a Ray actor, on this host or any host of the cluster.

The same ranks as the ``mp`` executor (each actor holds a ``RankRunner``, worker.py) and the
same step protocol, error rules and deadlines (multiproc.py); only the transport differs:
a step's ``ModelInput`` is put in Ray's object store once and each actor's ``step`` reads
it; replies are Ray object refs, waited for with ``ray.wait``. Ray runs one caller's calls
to an actor in the order they were made, so steps never overlap on a rank.

Connecting: ``ray.init()`` joins the cluster this host belongs to (``ray start --head`` /
``ray start --address``, or ``RAY_ADDRESS``) and otherwise starts a local one in this
process. The ranks meet for their collectives at rank 0's node address.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

from cadence.backend import Backend, WorkerLostError
from cadence.config import EngineConfig
from cadence.executor.multiproc import MultiprocExecutor, _free_port, _RankGone
from cadence.executor.worker import RankRunner


class RankActor(RankRunner):
    """A rank inside a Ray actor: the runner plus where it runs."""

    def placement(self) -> tuple[str, int, int]:
        """(this node's address, a free port on it, this process's id)."""
        import os

        import ray

        return ray.util.get_node_ip_address(), _free_port(), os.getpid()


class RayExecutor(MultiprocExecutor):
    """Runs ``backend_cls`` as ``world_size`` Ray actors (tensor-parallel ranks or pipeline
    stages); see the module doc."""

    executor_name = "ray"
    sends_bitmask_late = False  # an actor runs one call at a time: inside the step

    def __init__(self, backend_cls: type[Backend], config: EngineConfig) -> None:
        super().__init__(backend_cls, config)
        self._actors: list[Any] = []
        self._queues: list[deque] = []
        self._pids: list[int] = []

    def load_model(self) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                             "'cadence[ray]' (or pip install ray)") from None
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        self._in_flight = 0
        self._failure = None
        actor_cls = ray.remote(num_cpus=1)(RankActor)
        self._actors = [actor_cls.remote(self.rank_spec(r, "")) for r in range(self.world_size)]
        self._queues = [deque() for _ in self._actors]
        try:
            places = ray.get([a.placement.remote() for a in self._actors],
                             timeout=self.step_timeout_s)
        except Exception as e:
            self._kill_ranks()
            raise RuntimeError(f"Ray could not place the {self.world_size} ranks: "
                               f"{type(e).__name__}: {e}") from e
        host, port, _ = places[0]
        self._pids = [pid for _, _, pid in places]
        init_method = f"tcp://{host}:{port}"
        # A rank's index among the ranks Ray put on its node: the device it takes there.
        nodes = [node for node, _, _ in places]
        local_ranks = [nodes[:r].count(nodes[r]) for r in range(len(nodes))]
        for actor, queue, local in zip(self._actors, self._queues, local_ranks, strict=True):
            queue.append(actor.start.remote(init_method, local))

    # -- the transport (multiproc.py calls these) -------------------------------------------

    def _send_all(self, msg: Any) -> None:
        import ray

        if msg == "ping":
            refs = [a.ping.remote() for a in self._actors]
        else:
            shared = ray.put(msg)
            refs = [a.step.remote(shared) for a in self._actors]
        for queue, ref in zip(self._queues, refs, strict=True):
            queue.append(ref)

    def _wait(self, ranks: list[int], timeout: float | None) -> list[int]:
        import ray

        heads = {self._queues[r][0]: r for r in ranks}
        ready, _ = ray.wait(list(heads), num_returns=1, timeout=timeout)
        return [heads[ref] for ref in ready]

    def _read(self, rank: int) -> Any:
        import ray

        ref = self._queues[rank].popleft()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise _RankGone(f"died (its Ray actor is gone: {type(e).__name__})") from None
        except ray.exceptions.RayError as e:
            raise _RankGone(f"failed in Ray ({type(e).__name__}: {e})") from None

    def _kill_ranks(self) -> None:
        import ray

        for actor in self._actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        for queue in self._queues:
            queue.clear()

    # -- health and shutdown ----------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def check_health(self, deep: bool = False) -> None:
        if self._failure is not None:
            raise WorkerLostError(self._failure)
        if deep and self._actors and not self._in_flight:
            self._send_all("ping")
            self._gather(self.step_timeout_s)

    def shutdown(self) -> None:
        import ray

        if self._actors and self._failure is None:
            # A rank already gone is killed below either way.
            with contextlib.suppress(Exception):
                ray.get([a.shutdown.remote() for a in self._actors], timeout=10)
        self._kill_ranks()
        self._actors, self._queues, self._pids = [], [], []
        self._in_flight = 0
