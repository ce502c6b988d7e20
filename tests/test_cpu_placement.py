"""Where the CPU backend's processes run (backends/cpu/placement.py): each rank or replica
on its own share of the cores, ``--cpu-bind none`` sharing them, ``--cpu-reserved-cores``
keeping the model's threads off cores left to the engine process, and the refusals."""

from __future__ import annotations

import os

import pytest
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.config import ParallelConfig


def test_unbound_ranks_share_the_cores(monkeypatch):
    """``--cpu-bind none``: nothing is pinned, each rank (or replica) sizes its pool to an
    equal share of the cores, at least one; an unknown choice is refused by name."""
    from cadence.backends.cpu import placement

    monkeypatch.setattr(placement, "bind_to", lambda cpus: pytest.fail("pinned"))
    monkeypatch.setattr(placement, "available_cpus", lambda: [0, 1])
    both = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert placement.place(both, "none", ranks=True) == 1
    assert placement.place(ParallelConfig(tensor_parallel_size=2), "none", ranks=True) == 1
    assert placement.shared_threads(ParallelConfig(pipeline_parallel_size=2), True,
                                    list(range(8))) == 4
    assert placement.shared_threads(ParallelConfig(data_parallel_size=2,
                                                   tensor_parallel_size=2), False,
                                    list(range(8))) == 4
    assert placement.place(ParallelConfig(), "none", ranks=False) is None  # torch's default
    # A rank is always told its count (Ray starts actors with OMP_NUM_THREADS=1).
    assert placement.place(ParallelConfig(), "none", ranks=True) == 2
    with pytest.raises(ValueError, match=r"bind must be one of \('cores', 'none'\), got 'all'"):
        placement.place(both, "all", ranks=True)


def test_reserved_cores_are_left_to_the_engine(monkeypatch):
    """The first N cores are kept from the model's threads: a lone engine's worker binds to
    the rest, replicas and ranks split the rest, unbound ranks share it."""
    from cadence.backends.cpu import placement

    bound: list[list[int]] = []
    monkeypatch.setattr(placement, "bind_to",
                        lambda cpus: cpus and (bound.append(cpus) or len(cpus)))
    monkeypatch.setattr(placement, "available_cpus", lambda: list(range(8)))
    assert placement.place(ParallelConfig(), "cores", False, reserved=2) == 6
    assert placement.place(ParallelConfig(data_parallel_size=2, data_parallel_rank=1),
                           "cores", False, reserved=2) == 3
    assert placement.place(ParallelConfig(tensor_parallel_size=2, tensor_parallel_rank=0),
                           "cores", True, reserved=2) == 3
    assert bound == [[2, 3, 4, 5, 6, 7], [5, 6, 7], [2, 3, 4]]
    assert placement.place(ParallelConfig(), "none", False, reserved=2) == 6
    assert placement.place(ParallelConfig(pipeline_parallel_size=2), "none", True,
                           reserved=2) == 3
    assert placement.place(ParallelConfig(), "cores", False) is None  # nothing to do
    with pytest.raises(ValueError, match="--cpu-reserved-cores 8 leaves no core"):
        placement.compute_cpus(8)


def test_ranks_split_the_cores_of_their_own_node(monkeypatch):
    """Ray may put a model's ranks on several hosts: each host's cores are split among the
    ranks on that host (LOCAL_RANK of LOCAL_WORLD_SIZE), a rank alone on its host takes all
    of them; with every rank on one host (mp) the split is the global one."""
    from cadence.backends.cpu import placement

    eight = list(range(8))
    tp2pp2 = [ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).with_rank(r)
              for r in range(4)]
    # Stages on two hosts, two ranks each: every rank gets half its host, not a quarter.
    assert [placement.rank_cpus(p, eight, r % 2, 2) for r, p in enumerate(tp2pp2)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert placement.rank_cpus(tp2pp2[3], eight, 0, 1) == eight  # alone on its host
    global_split = [placement.rank_cpus(p, eight) for p in tp2pp2]
    assert global_split == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [placement.rank_cpus(p, eight, r, 4) for r, p in enumerate(tp2pp2)] == global_split
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 x --pipeline-parallel-size "
                                         "2, with 3 of its 4 ranks on this node, needs at "
                                         "least 3 CPU cores"):
        placement.rank_cpus(tp2pp2[0], [0, 1], 0, 3)
    # Unbound: the pool is an equal share of the host's cores among the ranks there.
    assert placement.place(tp2pp2[1], "none", True, local_rank=0, local_world_size=1) \
        == len(placement.available_cpus())
    monkeypatch.setattr(placement, "available_cpus", lambda: eight)
    monkeypatch.setattr(placement, "bind_to", lambda cpus: cpus)
    assert placement.place(tp2pp2[2], "cores", True, local_rank=1, local_world_size=3) == \
        [3, 4, 5]
    assert placement.place(tp2pp2[2], "none", True, local_rank=1, local_world_size=2) == 4
    # Bound, alone on its host with nothing to pin: still told how many threads to run.
    assert placement.place(ParallelConfig(), "cores", True) == 8


def test_a_rank_reads_its_place_on_the_node_from_the_executor(monkeypatch, tiny_model_dir):
    """The executor sets LOCAL_RANK and LOCAL_WORLD_SIZE (core/executor/worker.py) before a
    rank's backend joins the group; the CPU backend places itself by them."""
    import dataclasses

    from cadence.backend import Backend
    from cadence.backends.cpu import placement
    from cadence.backends.cpu.backend import CpuBackend
    from cadence.engine_args import EngineArgs

    config = EngineArgs(model=tiny_model_dir("qwen2"), tensor_parallel_size=2,
                        pipeline_parallel_size=2,
                        backend_options={"overlap": "sync"}).create_engine_config()
    config = dataclasses.replace(config, parallel_config=config.parallel_config.with_rank(3))
    seen = []
    monkeypatch.setattr(placement, "place", lambda *args: seen.append(args))
    monkeypatch.setattr(Backend, "init_distributed", lambda *args: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    CpuBackend(config).init_distributed(3, 4, "tcp://127.0.0.1:1", 1.0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not from an executor: the global split
    CpuBackend(config).init_distributed(3, 4, "tcp://127.0.0.1:1", 1.0)
    assert [args[-2:] for args in seen] == [(0, 1), (None, None)]


def test_placement_options_are_checked(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    cases = [({"overlap": "sync", "reserved_cores": 1},
              "--cpu-reserved-cores 1 on the cpu backend needs the 'process' overlap"),
             ({"overlap": "process", "reserved_cores": os.cpu_count()}, "leaves no core"),
             ({"overlap": "process", "reserved_cores": "one"},
              r"reserved_cores must be a whole number >= 0, got 'one'"),
             ({"overlap": "process", "bind": "all"}, r"bind must be one of \('cores', 'none'\)")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(model, num_kv_blocks=16, backend_options=options)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to reserve one")
def test_the_worker_runs_off_the_reserved_core(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    cpus = sorted(os.sched_getaffinity(0))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(model, num_kv_blocks=16,
                   backend_options={"overlap": "process", "reserved_cores": 1})
    try:
        worker = llm.engine.backend._worker._proc.pid
        assert sorted(os.sched_getaffinity(worker)) == cpus[1:]
        assert llm.engine.backend.env_info()["cpu_threads"] == str(len(cpus) - 1)
        # The bench's machine block reports the worker's threads, not torch's default.
        from cadence.bench.report import machine_info

        assert machine_info(llm.engine)["threads"] == len(cpus) - 1
        got = generate(llm, ["hello there"], params)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    plain = make_llm(model, num_kv_blocks=16)
    try:
        assert generate(plain, ["hello there"], params)[0].outputs[0].token_ids == got
    finally:
        plain.shutdown()
