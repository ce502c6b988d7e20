"""The ``ray`` executor on a local Ray cluster started the way a user starts one: TP=2 ranks,
and TP=2 inside each of PP=2 stages, as Ray actors in a placement group of one bundle per
rank, give one process's tokens and logprobs; a rank killed mid-run fails every pending
request with an error naming it, its group goes with it and the restart reserves another;
a group the cluster cannot place is refused at start-up with what was asked and what the
cluster has.

Runs wherever Ray is installed (``pip install 'cadence[ray]'``; CI installs it) and is
skipped otherwise. The module starts one cluster for all its tests with ``ray start --head
--block`` in a subprocess, and the engine joins it through ``RAY_ADDRESS``, as on the head
host of a multi-host cluster (docs/distributed.md). A Ray instance started by ``ray.init()``
in this process would be ~3 s cheaper, but would not test joining a cluster by its address.
Measured on 2 cores: the cluster starts in ~4 s, the engine joins it in ~1 s and it stops
in ~2 s; building the TP=2 engine (two actors importing torch, loading the model, forming
the gloo group) takes ~4 s, and its restart as much; the refused placement ~1 s (a 1 s
step timeout); the whole file ~29 s.

The cluster is private to the module: its own ``--temp-dir`` (so the address file that
``ray start`` writes, which a later bare ``ray.init()`` would follow, goes with it), auth
mode set explicitly (Ray 2.59+ turns on token auth when ``~/.ray/auth_token`` exists, and a
driver given an address does not), and it is stopped by terminating its ``ray start
--block`` process, which stops the processes it started, where ``ray stop`` would stop
every Ray process of this host.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from engine_helpers import assert_same_as, generate, lose_a_rank_mid_run, make_llm

from cadence import SamplingParams

NO_RAY = "Ray is not installed: pip install 'cadence[ray]'"
# Ray is imported when the tests run, not at collection: importing it puts its vendored
# packages (psutil, ...) first on sys.path, and at collection that would reach every test.
if importlib.util.find_spec("ray") is None:
    pytest.skip(NO_RAY, allow_module_level=True)

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node cluster from ``ray start --head``; RAY_ADDRESS points at it meanwhile."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    temp_dir = tempfile.mkdtemp(prefix="cadence-ray-")  # short: Ray's socket paths live here
    address = f"127.0.0.1:{_free_port()}"
    env_keys = ("RAY_ADDRESS", "RAY_AUTH_MODE")
    saved = {k: os.environ.get(k) for k in env_keys}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    log_path = Path(temp_dir) / "ray-start.log"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
           # Logical CPUs (one per actor) for four ranks, sharing however many cores
           # there are (--cpu-bind none below).
           "--num-cpus", "4", "--port", address.rsplit(":", 1)[1], "--temp-dir", temp_dir,
           "--include-dashboard=false", "--disable-usage-stats"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not start (rc={proc.poll()}):\n"
                            f"{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with contextlib.suppress(OSError):
            shutil.rmtree(temp_dir)


def _live_groups(ray) -> dict:
    """The cluster's placement groups that are not removed, by hex id."""
    return {gid: info for gid, info in ray.util.placement_group_table().items()
            if info["state"] != "REMOVED"}


def test_ray_ranks_match_one_process_and_a_lost_rank_fails_the_requests(ray_cluster,
                                                                        tiny_model_dir):
    """TP=2 in a placement group of two one-CPU bundles (PACK), each actor in its bundle;
    a rank killed mid-run fails every pending request, the group goes with its actors, and
    the restart reserves a new one, which serves as the first did and goes at shutdown."""
    import ray

    model = tiny_model_dir("qwen3")
    single = make_llm(model, num_kv_blocks=64)
    reference = generate(single, PROMPTS, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2,
                   distributed_executor_backend="ray")
    try:
        engine = llm.engine
        assert engine.backend.env_info()["executor"] == "ray"
        # The engine joined the cluster (not a Ray instance of its own in this process).
        assert ray.get_runtime_context().gcs_address.endswith(ray_cluster.rsplit(":", 1)[1])
        first = engine.backend.placement_group_id
        groups = _live_groups(ray)
        assert list(groups) == [first]
        assert groups[first]["strategy"] == "PACK"
        assert groups[first]["state"] == "CREATED"
        assert list(groups[first]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        # Each rank runs inside it (as the rank itself reports).
        assert engine.backend.rank_placement_groups == [first, first]
        assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        engine.guard.max_restarts = 1
        pids = engine.backend.worker_pids
        failed = lose_a_rank_mid_run(engine, PROMPTS, pids[1], True, "", warmup_steps=1)
        assert sorted(o.request_id for o in failed) == ["k0", "k1"]
        assert all("rank 1 of 2 died" in o.error for o in failed)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert _live_groups(ray) == {}  # removed with the killed ranks

        # The restart (at the next step) reserves a new group and serves as before.
        assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
        second = engine.backend.placement_group_id
        assert second not in (None, first)
        assert list(_live_groups(ray)) == [second]
        assert engine.backend.rank_placement_groups == [second, second]
        assert not set(engine.backend.worker_pids) & set(pids)
    finally:
        llm.shutdown()
    assert _live_groups(ray) == {}
    assert engine.backend.placement_group_id is None


def test_ray_refuses_ranks_the_cluster_cannot_place(ray_cluster, tiny_model_dir):
    """STRICT_SPREAD wants each of the two ranks on a node of its own; the one-node cluster
    cannot hold that, so the engine fails once the (here short) start-up timeout has passed,
    saying what it asked for and what the cluster has, and leaves no group reserved."""
    import ray

    with pytest.raises(ValueError) as refused:
        make_llm(tiny_model_dir("qwen3"), num_kv_blocks=64, tensor_parallel_size=2,
                 distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
                 startup_timeout=1.0)
    message = str(refused.value)
    assert ("Ray could not place the 2 ranks within 1 s (--startup-timeout, startup_timeout)"
            in message)
    assert ("asked for 2 bundles of {'CPU': 1} with --ray-placement-strategy STRICT_SPREAD "
            "(each rank on a node of its own: 2 nodes)") in message
    assert "the cluster has 1 node(s) with CPU 4 in all, CPU 4 free" in message
    assert _live_groups(ray) == {}


def test_ray_tensor_parallel_inside_pipeline_stages(ray_cluster, tiny_model_dir):
    """TP=2 inside each of PP=2 stages, each rank a Ray actor: each stage's ranks form their
    own group, activations go actor to actor over gloo, the last stage's first rank's
    samples come back through Ray, two micro-batches in flight."""
    model = tiny_model_dir("qwen3")
    prompts = PROMPTS + ["hello", "zebra"]
    single = make_llm(model, num_kv_blocks=64)
    reference = generate(single, prompts, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2, pipeline_parallel_size=2,
                   distributed_executor_backend="ray",
                   backend_options={"overlap": "sync", "bind": "none"})
    try:
        info = llm.engine.backend.env_info()
        assert (info["executor"], info["tensor_parallel_size"],
                info["pipeline_parallel_size"]) == ("ray", "2", "2")
        assert len(set(llm.engine.backend.worker_pids)) == 4
        # Four one-CPU bundles on the cluster's four CPUs: placeable only because the
        # first test's group was removed at its engine's shutdown.
        assert len(set(llm.engine.backend.rank_placement_groups)) == 1
        outputs = generate(llm, prompts, GREEDY)
        assert_same_as(reference, outputs)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
