"""Where the ``ray`` executor's ranks run: one placement group bundle per rank.

Before any rank starts, the executor reserves a placement group with one bundle per rank,
``{"CPU": 1}`` plus the backend's ``ray_resources`` (``{"GPU": 1}`` for CUDA), under the
``--ray-placement-strategy`` (PACK by default: as few nodes as possible, so a tensor-parallel
group's collectives stay inside a node where it fits; vLLM does the same). Bundle ``r`` holds
rank ``r``; ranks are stage-major (``ParallelConfig.rank``), so the ranks of one
tensor-parallel group are consecutive bundles, which PACK fills node by node. The group is
all or nothing: if the cluster cannot hold it within the start-up timeout, nothing starts and
the error says what was asked and what the cluster has.

Pure functions of plain data here; the Ray calls are in ray_executor.py.
"""

from __future__ import annotations

from collections.abc import Mapping


def rank_bundles(world_size: int, resources: Mapping[str, float]) -> list[dict[str, float]]:
    """One bundle per rank: a CPU plus ``resources`` (a backend's ``ray_resources``; a
    "CPU" entry there replaces the one CPU)."""
    bundle = {"CPU": 1.0, **{name: float(n) for name, n in resources.items()}}
    return [dict(bundle) for _ in range(world_size)]


def actor_options(bundle: Mapping[str, float]) -> dict:
    """The ``ray.remote`` options of an actor that takes exactly ``bundle``: Ray names CPUs
    and GPUs by keyword and every other resource in ``resources``."""
    rest = {name: n for name, n in bundle.items() if name not in ("CPU", "GPU")}
    options: dict = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}
    if rest:
        options["resources"] = rest
    return options


def node_local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """Per rank, given each rank's node: (its index among the ranks on its node, how many
    ranks that node holds), i.e. LOCAL_RANK and LOCAL_WORLD_SIZE."""
    return [(nodes[:r].count(node), nodes.count(node)) for r, node in enumerate(nodes)]


def _amounts(resources: Mapping[str, float], names: list[str]) -> str:
    return ", ".join(f"{name} {resources.get(name, 0):g}" for name in names)


def placement_request(bundles: list[dict[str, float]], strategy: str,
                      total: Mapping[str, float], free: Mapping[str, float],
                      num_nodes: int) -> str:
    """What was asked (bundles, strategy) and what the cluster has
    (``ray.cluster_resources()``, ``ray.available_resources()``, its live nodes), for the
    messages of a placement group that does not come."""
    names = list(dict.fromkeys(name for bundle in bundles for name in bundle))
    asked = ", ".join(f"{k!r}: {v:g}" for k, v in bundles[0].items())
    hint = {"STRICT_SPREAD": f"each rank on a node of its own: {len(bundles)} nodes",
            "STRICT_PACK": "every rank on one node"}.get(strategy)
    return (f"asked for {len(bundles)} bundles of {{{asked}}} with --ray-placement-strategy "
            f"{strategy}{f' ({hint})' if hint else ''}; the cluster has {num_nodes} "
            f"node(s) with {_amounts(total, names)} in all, {_amounts(free, names)} free "
            f"(ray status shows each node)")
