"""Which cores a CPU engine's worker runs on when several engines serve side by side.

Replicas of one model in one server (``engine serve --data-parallel-size N``) would all
start torch's thread pool on every core, and N pools fighting over the same cores run
slower than one. Each replica's worker instead takes a contiguous 1/N of the cores this
process may use (its affinity mask, which respects ``taskset`` and container limits),
binds itself to them and sizes its pool to match, as vLLM's CPU backend binds each rank's
OpenMP threads to its own cores. The ranks of a model split by tensor or pipeline parallel
are placed the same way inside their engine's share, split among the ranks on the same
node (all of them under ``mp``; under ``ray`` those its placement group put there).

``--cpu-bind none`` (backend option ``bind``) binds nothing: every process may run on every
core and sizes its pool to its equal share of them (at least one thread). Slower where the
cores are few, since the pools then meet on the same cores, but it runs more ranks than
cores (a tensor x pipeline split tried on a small machine) and leaves placement to the
operating system or to an outer ``taskset``.

``--cpu-reserved-cores N`` (backend option ``reserved_cores``) keeps the model's threads off
the first N cores, for the engine process: where cores are plenty, the host's work of a
step (scheduling, building the input, output processing) then overlaps the forward
instead of taking a core from its thread pool, which is what async scheduling needs to pay
off (docs/performance.md). vLLM's CPU backend reserves cores for its front end the same way.
"""

from __future__ import annotations

import os

from cadence.config import EngineConfig, ParallelConfig
from cadence.distributed import even_share

BIND_CHOICES = ("cores", "none")


def available_cpus() -> list[int]:
    """The cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (not Linux): every core counts
        return list(range(os.cpu_count() or 1))


def replica_cpus(parallel: ParallelConfig, cpus: list[int] | None = None) -> list[int] | None:
    """The cores of replica ``data_parallel_rank``, or None for a lone engine (it keeps the
    whole machine). ValueError when there are fewer cores than replicas."""
    size, rank = parallel.data_parallel_size, parallel.data_parallel_rank
    if size == 1:
        return None
    cpus = available_cpus() if cpus is None else cpus
    if len(cpus) < size:
        raise ValueError(f"--data-parallel-size {size} needs at least {size} CPU cores, one "
                         f"per replica; this process may use {len(cpus)} ({cpus})")
    # The first len % size replicas get one core more; every core belongs to one replica.
    share = even_share(len(cpus), rank, size)
    return cpus[share.start:share.stop]


def rank_cpus(parallel: ParallelConfig, cpus: list[int] | None = None,
              local_rank: int | None = None,
              local_world_size: int | None = None) -> list[int] | None:
    """The cores of rank ``parallel.rank`` (a tensor-parallel rank or a pipeline stage): its
    contiguous share of its replica's cores (of all of them for a lone engine), so the
    ranks' thread pools never share a core. None for an unsplit model (it keeps the
    replica's share). ValueError when there are fewer cores than ranks.

    The cores are split among the ranks on this node: rank ``local_rank`` of
    ``local_world_size`` (the ``ray`` executor's ranks may be spread over several hosts, and a
    rank alone on its node takes all of it). Both default to the global rank and world size:
    one host holds every rank (``mp``)."""
    size = parallel.world_size if local_world_size is None else local_world_size
    rank = parallel.rank if local_rank is None else local_rank
    assert 0 <= rank < size, f"local rank {rank} of {size}"
    if parallel.world_size == 1:
        return replica_cpus(parallel, cpus)
    share = replica_cpus(parallel, cpus) or (available_cpus() if cpus is None else cpus)
    if len(share) < size:
        raise ValueError(f"{_split_flags(parallel, size)} needs at least {size} CPU cores, "
                         f"one per rank; this engine may use {len(share)} ({share}); "
                         f"--cpu-bind none runs the ranks on shared cores instead")
    mine = even_share(len(share), rank, size)
    return share[mine.start:mine.stop]


def _split_flags(parallel: ParallelConfig, local_world_size: int) -> str:
    """The flags that asked for ``local_world_size`` ranks on this node, for errors."""
    size = parallel.world_size
    split = (f"--tensor-parallel-size {parallel.tensor_parallel_size} x "
             f"--pipeline-parallel-size {parallel.pipeline_parallel_size}"
             if parallel.tensor_parallel_size > 1 and parallel.pipeline_parallel_size > 1
             else f"--pipeline-parallel-size {size}" if parallel.pipeline_parallel_size > 1
             else f"--tensor-parallel-size {size}")
    if local_world_size != size:
        return f"{split}, with {local_world_size} of its {size} ranks on this node,"
    return split


def bind_to(cpus: list[int] | None) -> int | None:
    """Pin this process to ``cpus``; the thread count to use (None: leave torch's)."""
    if not cpus:
        return None
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    return len(cpus)


def check_bind(bind: str) -> str:
    if bind not in BIND_CHOICES:
        raise ValueError(f"cpu backend option bind must be one of {BIND_CHOICES}, got {bind!r}")
    return bind


def placement_options(config: EngineConfig) -> tuple[str, int]:
    """The backend options ``bind`` and ``reserved_cores``, checked."""
    bind = check_bind(str(config.backend_option("bind", "cores")))
    raw = config.backend_option("reserved_cores", 0)
    try:
        reserved = int(raw)
    except (TypeError, ValueError):
        reserved = -1
    if reserved < 0:
        raise ValueError(f"cpu backend option reserved_cores must be a whole number >= 0, "
                         f"got {raw!r}")
    return bind, reserved


def compute_cpus(reserved: int, cpus: list[int] | None = None) -> list[int]:
    """The cores the model's threads may use: all but the first ``reserved`` of this
    process's, which are left to the engine process (scheduling, output processing, the
    server) so that its work overlaps the forward instead of taking a core from it.
    ValueError when that leaves none."""
    cpus = available_cpus() if cpus is None else cpus
    if reserved >= len(cpus):
        raise ValueError(f"--cpu-reserved-cores {reserved} leaves no core for the model: this "
                         f"process may use {len(cpus)} ({cpus})")
    return cpus[reserved:]


def shared_threads(parallel: ParallelConfig, ranks: bool,
                   cpus: list[int] | None = None,
                   local_world_size: int | None = None) -> int | None:
    """Unbound (``bind`` none): the threads of one of the engine's ranks (``ranks``; one of
    ``local_world_size`` on this node, all of them by default) or of one replica's worker,
    an equal share of ``cpus`` (this process's cores by default) and at least one; None for
    a lone, unsplit engine's worker given no cores (torch's default). A rank always gets a
    count: Ray starts its actors with OMP_NUM_THREADS=1, which torch's default would keep."""
    on_node = parallel.world_size if local_world_size is None else local_world_size
    parts = parallel.data_parallel_size * (on_node if ranks else 1)
    if parts == 1 and cpus is None and not ranks:
        return None
    return max(1, len(available_cpus() if cpus is None else cpus) // parts)


def place(parallel: ParallelConfig, bind: str, ranks: bool, reserved: int = 0,
          local_rank: int | None = None, local_world_size: int | None = None) -> int | None:
    """Bind this process (a rank when ``ranks``, else the worker process of an engine or
    of a replica) to its cores, or not with ``bind`` none, leaving the first ``reserved``
    cores alone; the thread count its pool should have (None: torch's). A rank's share is
    of its node's cores, by ``local_rank`` of ``local_world_size`` (``rank_cpus``)."""
    cpus = compute_cpus(reserved) if reserved else None
    if check_bind(bind) == "none":
        return shared_threads(parallel, ranks, cpus, local_world_size)
    mine = rank_cpus(parallel, cpus, local_rank, local_world_size) if ranks \
        else replica_cpus(parallel, cpus)
    threads = bind_to(mine if mine is not None else cpus)
    if threads is None and ranks:  # the whole node, counted (see ``shared_threads``)
        threads = len(available_cpus())
    return threads
