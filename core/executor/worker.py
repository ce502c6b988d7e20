"""One rank of the ``mp`` executor: a fresh interpreter that builds the backend for its rank
and runs every step the engine sends.

Protocol over the process's stdin/stdout: the engine sends one pickle with the start-up
spec, then ``ModelInput``s (or "ping", or None to stop). Replies are length-prefixed pickles:
("ready", num_blocks, env_info) or ("error", is_user_error, message, traceback) at start-up,
then one reply per step, in order: the output rank's ``SamplerOutput`` (rank 0, or the
last pipeline stage), None from the other ranks (tensor parallel: their samples are
identical, so only one crosses the pipe; pipeline parallel: earlier stages draw none), or
("error", traceback).

NOTE pipes: the framing and the input thread are the CPU forward worker's too (pipes.py).
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from cadence.executor.pipes import exit_with_parent, read_inputs, reply
from cadence.structured_output.bitmask import expect_after_step, is_bitmask_message


class RankRunner:
    """One rank's backend, built from the executor's start-up spec (config, rank,
    world_size, init_method, join_timeout, output_rank); runs steps one after the other. Shared by the
    ``mp`` worker loop below and the ``ray`` executor's actors."""

    def __init__(self, spec: dict) -> None:
        self.rank = spec["rank"]
        self.backend = None
        self.spec = spec

    def start(self, init_method: str | None = None, local_rank: int | None = None,
              local_world_size: int | None = None) -> tuple:
        """("ready", num_blocks, env_info) or ("error", is_user_error, message, traceback).
        ``init_method`` replaces the spec's (an address known only once ranks are placed),
        ``local_rank`` the rank's index among the ranks on its host and ``local_world_size``
        their number (the rank itself and the world size when they all share one)."""
        from cadence.distributed import experts_held, set_expert_parallel
        from cadence.plugins import get_registry

        spec = self.spec
        if init_method is not None:
            spec["init_method"] = init_method
        # torchrun's variables, set before the backend exists: device stacks pick a rank's
        # device from LOCAL_RANK when they are first imported (Gaudi's bridge does, and a
        # CUDA plugin can follow the same convention); the CPU backend splits its node's
        # cores by LOCAL_RANK among LOCAL_WORLD_SIZE.
        os.environ["RANK"] = str(self.rank)
        os.environ["LOCAL_RANK"] = str(self.rank if local_rank is None else local_rank)
        os.environ["WORLD_SIZE"] = str(spec["world_size"])
        os.environ["LOCAL_WORLD_SIZE"] = str(spec["world_size"] if local_world_size is None
                                             else local_world_size)
        try:
            config = spec["config"]
            # The class the engine's process probed and chose: a rank does not probe again
            # (its device may be busy with another rank, or taken only once it is built).
            name = spec.get("backend")
            registry = get_registry()
            backend_cls = registry.backends[name].cls if name in registry.backends \
                else registry.select(config.backend)[0]
            self.backend = backend_cls(config)
            # Before the model is built: it reads which experts this rank holds.
            set_expert_parallel(config.parallel_config.enable_expert_parallel,
                                config.parallel_config.expert_placement_strategy)
            self.backend.init_distributed(self.rank, spec["world_size"], spec["init_method"],
                                          spec["join_timeout"])
            self.backend.load_model()
            num_blocks = self.backend.allocate_kv_cache()
            self.backend.warmup()
        except BaseException as e:
            return ("error", isinstance(e, ValueError), str(e), traceback.format_exc())
        info = self.backend.env_info()
        if experts_held() is not None:
            info["experts_held"] = experts_held()
        return ("ready", num_blocks, info)

    def step(self, model_input: Any) -> Any:
        """The output rank's ``SamplerOutput``, None from the others, or ("error",
        traceback)."""
        from cadence.backend import PostSample

        try:
            t0 = time.perf_counter()
            if self.spec["config"].plans_with_placeholders:
                # The placeholder protocol lives in submit/collect (the backend keeps the
                # last sampled ids there); one step at a time is still in flight here.
                self.backend.submit(model_input)
                result = self.backend.collect()
            else:
                result = self.backend.execute(model_input, PostSample(None))
            result.device_seconds = time.perf_counter() - t0
            result.device_done_at = time.monotonic()
        except BaseException:
            # A plain tuple: this module runs as ``__main__`` in a worker, so a class
            # defined in it would pickle under a name the engine process cannot import.
            return ("error", traceback.format_exc())
        return result if self.rank == self.spec.get("output_rank", 0) else None

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    runner = RankRunner(pickle.load(inp))
    started = runner.start()
    reply(out, started)
    if started[0] == "error":
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_inputs, args=(inp, inbox), daemon=True,
                     name=f"cadence-rank{runner.rank}-inputs").start()
    while True:
        msg = inbox.get()
        if msg is None:
            break
        if is_bitmask_message(msg):
            # For a stage that samples nothing, or a step that failed before it sampled.
            continue
        if msg == "ping":
            reply(out, runner.ping())
            continue
        expect_after_step(msg.sampling.grammar, inbox)
        reply(out, runner.step(msg))
    runner.shutdown()


def main() -> None:
    exit_with_parent()
    # The protocol owns the original stdout; anything the model stack prints goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, proto_out)
    # Nothing is left to save and the engine waits for this exit: skip the interpreter's
    # teardown (and torch.distributed's, which would wait for the other ranks).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
