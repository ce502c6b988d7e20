"""The ``ray`` executor on a local Ray cluster started the way a user starts one: TP=2 ranks,
and TP=2 inside each of PP=2 stages, as Ray actors give one process's tokens and logprobs,
and a rank killed mid-run fails every pending request with an error naming it.

Runs wherever Ray is installed (``pip install 'cadence[ray]'``; CI installs it) and is
skipped otherwise. The module starts one cluster for all its tests with ``ray start --head
--block`` in a subprocess, and the engine joins it through ``RAY_ADDRESS``, as on the head
host of a multi-host cluster (docs/distributed.md). A Ray instance started by ``ray.init()``
in this process would be ~3 s cheaper, but would not test joining a cluster by its address.
Measured on 2 cores: the cluster starts in ~5 s, the engine joins it in ~1 s and it stops
in ~2 s; building the TP=2 engine (two actors importing torch, loading the model, forming
the gloo group) takes ~5 s; the whole file ~25 s, ~18 s without the tiny model's build,
which the suite shares with other tests.

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
from engine_helpers import assert_same_as, generate, make_llm

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


def test_ray_ranks_match_one_process_and_a_lost_rank_fails_the_requests(ray_cluster,
                                                                        tiny_model_dir):
    import ray

    from cadence.faults import EngineFailedError

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
        assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        engine.guard.max_restarts = 0
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"k{i}", prompt, SamplingParams(max_tokens=200,
                                                               ignore_eos=True))
        engine.step()
        os.kill(engine.backend.worker_pids[1], signal.SIGKILL)
        with pytest.raises(EngineFailedError, match="rank 1 of 2 died"):
            for _ in range(50):
                engine.step()
        failed = [o for o in engine.output_processor.take_ready() if o.finished]
        assert sorted(o.request_id for o in failed) == ["k0", "k1"]
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


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
        outputs = generate(llm, prompts, GREEDY)
        assert_same_as(reference, outputs)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
