"""The ``ray`` executor: each rank is a Ray actor, on this host or any host of the cluster.

The same ranks as the ``mp`` executor (each actor holds a ``RankRunner``, worker.py) and the
same step protocol, error rules and deadlines (rank_group.py); only the transport differs:
a step's ``ModelInput`` is put in Ray's object store once and each actor's ``step`` reads
it; replies are Ray object refs, waited for with ``ray.wait``. Ray runs one caller's calls
to an actor in the order they were made, so steps never overlap on a rank.

Placement (ray_placement.py): a placement group with one bundle per rank, ``{"CPU": 1}``
plus the backend's ``ray_resources``, under ``--ray-placement-strategy``; rank ``r``'s actor
runs in bundle ``r``. The group lives as long as its actors: it is removed whenever they are
killed (a lost group, a failed start, ``shutdown``), and a restart reserves a new one.

Connecting: ``ray.init()`` joins the cluster this host belongs to (``ray start --head`` /
``ray start --address``, or ``RAY_ADDRESS``) and otherwise starts a local one in this
process. The ranks meet for their collectives at rank 0's node address.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Any

from cadence.backend import Backend
from cadence.config import EngineConfig
from cadence.executor.multiproc import _free_port
from cadence.executor.pipes import START_NOTICE_S, on_interrupt
from cadence.executor.rank_group import RankGroup, _RankGone
from cadence.executor.ray_placement import (
    actor_options,
    node_local_ranks,
    placement_request,
    rank_bundles,
)
from cadence.executor.worker import RankRunner

logger = logging.getLogger(__name__)
# After this long without a placement group, the engine first logs what it waits for.
RESERVE_NOTICE_S = 10.0


class RankActor(RankRunner):
    """A rank inside a Ray actor: the runner plus where it runs."""

    def placement(self) -> tuple[str, int, int, str | None]:
        """(this node's address, a free port on it, this process's id, the placement group
        this actor runs in as a hex id, None outside one)."""
        import os

        import ray

        return (ray.util.get_node_ip_address(), _free_port(), os.getpid(),
                ray.get_runtime_context().get_placement_group_id())


class RayExecutor(RankGroup):
    """Runs ``backend_cls`` as ``world_size`` Ray actors (tensor-parallel ranks or pipeline
    stages) in a placement group of their own; see the module doc."""

    executor_name = "ray"
    sends_bitmask_late = False  # an actor runs one call at a time: inside the step

    def __init__(self, backend_cls: type[Backend], config: EngineConfig) -> None:
        super().__init__(backend_cls, config)
        self._actors: list[Any] = []
        self._queues: list[deque] = []
        self._pids: list[int] = []
        self._group: Any = None  # the ranks' placement group while they exist
        #: Each rank's placement group id as the rank itself reports it (operators, tests).
        self.rank_placement_groups: list[str | None] = []

    @property
    def placement_group_id(self) -> str | None:
        """The hex id of the ranks' placement group; None while there is none."""
        return None if self._group is None else self._group.id.hex()

    def load_model(self) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                             "'cadence[ray]' (or pip install ray)") from None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._start_began = time.monotonic()
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        self._in_flight = 0
        self._failure = None
        bundles = rank_bundles(self.world_size, self.backend_cls.ray_resources)
        self._reserve(bundles)
        actor_cls = ray.remote(RankActor)
        self._actors = [actor_cls.options(
            **actor_options(bundle), scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=r),
        ).remote(self.rank_spec(r, "")) for r, bundle in enumerate(bundles)]
        self._queues = [deque() for _ in self._actors]
        try:
            places = ray.get([a.placement.remote() for a in self._actors],
                             timeout=self._startup_left())
        except Exception as e:
            self._kill_ranks()
            raise RuntimeError(f"Ray could not start the {self.world_size} ranks: "
                               f"{type(e).__name__}: {e}") from e
        host, port, _, _ = places[0]
        self._pids = [place[2] for place in places]
        self.rank_placement_groups = [place[3] for place in places]
        init_method = f"tcp://{host}:{port}"
        # Per rank, its index among the ranks on its host and their number: the device it
        # takes there, and its share of the host's cores.
        local = node_local_ranks([place[0] for place in places])
        for actor, queue, (rank, size) in zip(self._actors, self._queues, local, strict=True):
            queue.append(actor.start.remote(init_method, rank, size))

    def _reserve(self, bundles: list[dict[str, float]]) -> None:
        """Reserve the ranks' placement group, waiting up to the start-up timeout;
        ValueError (nothing left reserved) when the cluster cannot hold it by then."""
        import ray
        from ray.util.placement_group import placement_group

        def request() -> str:
            nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
            return placement_request(bundles, strategy, ray.cluster_resources(),
                                     ray.available_resources(), nodes)

        self._remove_group()  # never two groups for one set of ranks
        strategy = self.config.parallel_config.ray_placement_strategy
        self._group = placement_group(bundles, strategy=strategy)
        # A busy cluster may free the resources later (autoscaling, other jobs ending): say
        # so early and then now and again, waiting out the start-up timeout.
        limit = self.startup_timeout_s
        began = time.monotonic()
        notice = RESERVE_NOTICE_S
        while True:
            left = self._startup_left()
            if left is not None and left <= 0:
                break
            if self._group.wait(timeout_seconds=notice if left is None else min(notice, left)):
                return
            if left is None or left > notice:
                logger.warning("waiting %.0f s so far for Ray to place the ranks: %s",
                               time.monotonic() - began, request())
            notice = START_NOTICE_S
        message = (f"Ray could not place the {len(bundles)} ranks within {limit:g} s "
                   f"(--startup-timeout, startup_timeout): {request()}")
        self._remove_group()
        raise ValueError(message)

    def _remove_group(self) -> None:
        from ray.util.placement_group import remove_placement_group

        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):  # already gone with the cluster
                remove_placement_group(group)

    # -- the transport (rank_group.py calls these) ------------------------------------------

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
        # The actors are gone for good (a restart reserves a new group): free their bundles.
        self._remove_group()

    # -- health and shutdown ----------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def check_health(self, deep: bool = False) -> None:
        if self._failure is not None:
            raise self._failure_error()
        if deep and self._actors and not self._in_flight:
            with on_interrupt(self._interrupted):
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
        self.rank_placement_groups = []
        self._in_flight = 0
