"""Where the ``ray`` executor's ranks run, without Ray (core/executor/ray_placement.py): the
placement group's bundles from each backend's ``ray_resources``, the actors' options, the
node-local ranks, the message of a group that cannot be placed, and the
``--ray-placement-strategy`` option. tests/test_ray_executor.py runs them on a Ray cluster."""

from __future__ import annotations

import argparse

import pytest

from cadence.backends.cpu.backend import CpuBackend
from cadence.backends.cuda.backend import CudaBackend
from cadence.backends.hpu.backend import HpuBackend
from cadence.config import RAY_PLACEMENT_STRATEGIES, ParallelConfig
from cadence.executor.ray_placement import (
    actor_options,
    node_local_ranks,
    placement_request,
    rank_bundles,
)


def test_one_bundle_per_rank_with_the_backends_device():
    assert CpuBackend.ray_resources == {}
    assert rank_bundles(2, CpuBackend.ray_resources) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert rank_bundles(3, CudaBackend.ray_resources) == [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert rank_bundles(1, HpuBackend.ray_resources) == [{"CPU": 1.0, "HPU": 1.0}]
    bundles = rank_bundles(2, {"GPU": 1})
    bundles[0]["GPU"] = 2.0  # each bundle is a dict of its own
    assert bundles[1] == {"CPU": 1.0, "GPU": 1.0}
    assert rank_bundles(1, {"CPU": 4}) == [{"CPU": 4.0}]  # a backend may want more CPUs


def test_an_actor_asks_for_exactly_its_bundle():
    assert actor_options({"CPU": 1.0}) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert actor_options({"CPU": 1.0, "GPU": 1.0}) == {"num_cpus": 1.0, "num_gpus": 1.0}
    # Ray refuses CPU and GPU inside ``resources``; every other name goes there.
    assert actor_options({"CPU": 1.0, "HPU": 1.0}) == {"num_cpus": 1.0, "num_gpus": 0.0,
                                                       "resources": {"HPU": 1.0}}


def test_node_local_ranks():
    # Stage-major ranks of TP=2 x PP=2 packed two per node, one node alone, all on one.
    assert node_local_ranks(["a", "a", "b", "b"]) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert node_local_ranks(["a", "b", "a"]) == [(0, 2), (0, 1), (1, 2)]
    assert node_local_ranks(["a"] * 3) == [(0, 3), (1, 3), (2, 3)]  # as under mp


def test_the_unplaceable_message_names_the_request_and_the_cluster():
    message = placement_request(rank_bundles(4, {"GPU": 1}), "STRICT_PACK",
                                {"CPU": 16.0, "GPU": 2.0, "memory": 1e10},
                                {"CPU": 12.0}, 2)
    assert message == ("asked for 4 bundles of {'CPU': 1, 'GPU': 1} with "
                       "--ray-placement-strategy STRICT_PACK (every rank on one node); the "
                       "cluster has 2 node(s) with CPU 16, GPU 2 in all, CPU 12, GPU 0 free "
                       "(ray status shows each node)")
    assert "(each rank on a node of its own: 2 nodes)" in placement_request(
        rank_bundles(2, {}), "STRICT_SPREAD", {"CPU": 4.0}, {"CPU": 4.0}, 1)
    assert "PACK;" in placement_request(rank_bundles(2, {}), "PACK", {}, {}, 0)


def test_the_strategy_option():
    from cadence.engine_args import EngineArgs

    assert ParallelConfig().ray_placement_strategy == "PACK"
    for strategy in RAY_PLACEMENT_STRATEGIES:
        assert ParallelConfig(ray_placement_strategy=strategy).ray_placement_strategy \
            == strategy
    with pytest.raises(ValueError, match=r"ray_placement_strategy must be one of \('PACK', "
                                         r"'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'\), "
                                         r"got 'pack'"):
        ParallelConfig(ray_placement_strategy="pack")
    # A rank's view of the config keeps it.
    assert ParallelConfig(tensor_parallel_size=2, ray_placement_strategy="SPREAD") \
        .with_rank(1).ray_placement_strategy == "SPREAD"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--ray-placement-strategy", "STRICT_SPREAD"])
    assert EngineArgs.from_cli_args(ns)[0].ray_placement_strategy == "STRICT_SPREAD"
    assert EngineArgs.from_cli_args(parser.parse_args([]))[0].ray_placement_strategy == "PACK"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ray-placement-strategy", "ANYWHERE"])
