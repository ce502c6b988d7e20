"""CPU backend: torch on the host, attention over the paged cache in torch ops.

torch CPU ops are synchronous, so "enqueue the forward" is not possible on one thread;
overlap needs a second worker. Strategies (``backend_options["overlap"]``):

- ``sync``: forward -> sample -> post_sample, all on the engine thread. No overlap; the
  reference the others must match.
- ``thread``: the forward and sampling run on a worker thread while the calling thread runs
  post_sample. Correct, but on 2 cores the GIL hand-over per op and two OpenMP pools make
  both sides slower; kept for machines with cores to spare.
- ``process`` (the default): a worker process owns the model and KV cache
  (backends/cpu/worker.py); the engine process runs post_sample while the worker computes.
  Real overlap, at the price of a pickled ModelInput per step and a few seconds of start-up.
  Measured fastest here (docs/backends/cpu.md): equal to ``sync`` when host work is
  negligible, 1.2x faster when it is a large share of the step; ``thread`` is slowest.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cadence.backend import (
    Backend,
    ModelInput,
    PostSample,
    ProbeResult,
    SamplerOutput,
    WorkerLostError,
)
from cadence.config import EngineConfig
from cadence.executor.pipes import on_interrupt
from cadence.plugins import check_backend_options

# torch is imported inside methods: registering and probing this backend (engine backends,
# engine --help) must not load torch.

OVERLAP_STRATEGIES = ("sync", "thread", "process")
DEFAULT_OVERLAP = "process"
# The backend_options the CPU backend reads (its --cpu-* flags put them there).
OPTION_KEYS = ("overlap", "kv_cache_gb", "attention", "linear", "huge_pages", "bind",
               "reserved_cores")
DEFAULT_KV_CACHE_GB = 2.0


class CpuBackend(Backend):
    """Runs the model with torch on the CPU."""

    name = "cpu"
    # Every strategy runs the model through ModelRunner, which fills placeholders from the
    # last sampled ids it keeps (in the worker process for ``process``).
    supports_async_scheduling = True
    # Each replica's worker process binds to its own share of the cores (placement.py).
    supports_data_parallel = True
    # Each rank runs in its executor's worker process on its share of the cores; the
    # collectives between them go over gloo.
    supports_tensor_parallel = True
    # Each stage runs its layers in its own worker process; activations go over gloo.
    supports_pipeline_parallel = True
    distributed_backend = "gloo"
    # ModelRunner computes them after the forward, in every strategy.
    supports_prompt_logprobs = True
    supports_pooling = True
    supports_lora = True
    supports_speculative = True
    supports_quantization = ("gguf", "int8", "awq", "gptq", "compressed-tensors")

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_backend_options(config.backend_options, "cpu", OPTION_KEYS)
        self.overlap = str(config.backend_option("overlap", DEFAULT_OVERLAP))
        if self.overlap not in OVERLAP_STRATEGIES:
            raise ValueError(
                f"cpu overlap must be one of {OVERLAP_STRATEGIES}, got {self.overlap!r}")
        self._pool: ThreadPoolExecutor | None = None
        self._futures: deque[Future] = deque()  # thread strategy, async scheduling
        # process strategy: per step in flight, the error of a late bitmask that could not
        # be computed (or None), raised when that step's reply is read (_result).
        self._bitmask_failures: deque[BaseException | None] = deque()
        self._worker = None
        self.runner = None
        self.runtime_info: dict[str, str] = {}
        self._in_rank = False  # built by an executor in a rank's own process

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "torch CPU")

    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        from cadence.backends.cpu.placement import compute_cpus, placement_options, rank_cpus

        super().check_parallel_config(config)
        bind, reserved = placement_options(config)
        # Too few cores for the ranks: say so now. Ray's ranks may be on other nodes: each
        # checks its own node's cores when it starts.
        if bind == "cores" and config.parallel_config.executor != "ray":
            rank_cpus(config.parallel_config, compute_cpus(reserved))

    def init_distributed(self, rank: int, world_size: int, init_method: str,
                         join_timeout: float) -> None:
        """In a rank's own process: the model runs here (``sync``: the process is the
        worker), bound to this rank's share of its node's cores before torch starts its
        pool. The ranks on this node split them: LOCAL_RANK of LOCAL_WORLD_SIZE, which the
        executor set (torchrun's names; every rank under ``mp``)."""
        import os

        import torch

        from cadence.backends.cpu.placement import place, placement_options

        self._in_rank = True
        self.overlap = "sync"
        bind, reserved = placement_options(self.config)
        env = os.environ
        on_node = "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env
        num_threads = place(self.config.parallel_config, bind, True, reserved,
                            int(env["LOCAL_RANK"]) if on_node else None,
                            int(env["LOCAL_WORLD_SIZE"]) if on_node else None)
        if num_threads:
            torch.set_num_threads(num_threads)
        super().init_distributed(rank, world_size, init_method, join_timeout)

    def _check_placement(self) -> None:
        """Refuse, before the worker starts, what its placement could not honour: replicas
        or reserved cores without a worker process of their own, too few cores."""
        from cadence.backends.cpu.placement import compute_cpus, placement_options, replica_cpus

        bind, reserved = placement_options(self.config)
        replicas = self.config.parallel_config.data_parallel_size > 1
        if (replicas or reserved) and self.overlap != "process":
            what = ("data parallel serving" if replicas else
                    f"--cpu-reserved-cores {reserved}")
            raise ValueError(f"{what} on the cpu backend needs the 'process' overlap strategy "
                             f"(the model runs in a worker process placed on its own cores); "
                             f"got {self.overlap!r}")
        cpus = compute_cpus(reserved) if reserved else None
        if replicas and bind == "cores":
            replica_cpus(self.config.parallel_config, cpus)  # too few cores: say so now

    def _kv_cache_bytes(self) -> int:
        gb = self.config.backend_option("kv_cache_gb", DEFAULT_KV_CACHE_GB)
        try:
            value = float(gb)
        except (TypeError, ValueError):
            value = float("nan")
        if isinstance(gb, bool) or not 0 < value <= 1 << 20:  # NaN fails too
            raise ValueError(f"the cpu backend's kv_cache_gb (--cpu-kv-cache-gb) must be a "
                             f"number of GiB > 0, got {gb!r}")
        return int(value * (1 << 30))

    def load_model(self) -> None:
        # The model, its packed GEMMs, the KV cache and the attention kernel are built in one
        # go (backends/cpu/runtime.py), in the worker process or here.
        if not self._in_rank:
            self._check_placement()
        if self.overlap == "process":
            from cadence.backends.cpu.worker import ForwardWorker

            # Started, not waited for: allocate_kv_cache waits, so the engine's own start-up
            # work runs meanwhile.
            self._worker = ForwardWorker(self.config, self._kv_cache_bytes())
            self._bitmask_failures.clear()
            return
        from cadence.backends.cpu.runtime import build_runtime

        rt = build_runtime(self.config, self._kv_cache_bytes())
        self.runner, self.num_blocks, self.runtime_info = rt.runner, rt.num_blocks, rt.describe()

    def allocate_kv_cache(self) -> int:
        if self._worker is not None:
            self._worker.wait_ready()
            self.num_blocks = self._worker.num_blocks
            self.runtime_info = self._worker.runtime_info
        return self.num_blocks

    def forward(self, model_input: ModelInput) -> Any:
        if self._worker is not None:
            # Enqueue: the worker samples too, so the "logits" are a handle to its reply.
            self._worker.submit(model_input)
            return None
        return self.runner.forward(model_input)

    def sample(self, logits, sampling):
        if self._worker is not None:
            return None
        return self.runner.sample(logits, sampling)

    def to_host(self, sampled) -> SamplerOutput:
        if self._worker is not None:
            return self._worker.result()
        return self.runner.to_host(sampled)

    def _forward_and_sample(self, model_input: ModelInput) -> SamplerOutput:
        out = self.to_host(self.sample(self.forward(model_input), model_input.sampling))
        out.device_done_at = time.monotonic()
        return out

    def execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        if self.overlap == "sync":
            return super().execute(model_input, post_sample)
        if self._worker is not None:
            grammar = model_input.sampling.grammar
            # Structured output: the worker runs the forward while the bitmask is computed
            # here, and waits for it before sampling.
            late = grammar is not None and not grammar.is_ready
            # One exchange: cut between the step and its bitmask, the worker would wait.
            with on_interrupt(self._worker.interrupted):
                self._worker.submit(model_input)
                failure = self._send_bitmask(grammar) if late else None
            try:
                if failure is None:
                    post_sample()
            finally:
                out = self._result(failure)
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cadence-cpu-forward")
        future = self._pool.submit(self._forward_and_sample, model_input)
        try:
            post_sample()
        finally:
            # Never leave the worker running while the caller raises: the next step would
            # race it for the KV cache.
            out = future.result()
        return out

    def submit(self, model_input: ModelInput) -> None:
        """Async scheduling. ``process``: the input goes down the pipe at once and the worker
        starts it as soon as the step before it is done; ``thread``: queued on the one
        forward thread; ``sync``: forward and sample run now (the base class)."""
        if self._worker is not None:
            grammar = model_input.sampling.grammar
            late = grammar is not None and not grammar.is_ready
            with on_interrupt(self._worker.interrupted):  # the step and its bitmask: one
                self._worker.submit(model_input)
                # The worker may be computing meanwhile.
                self._bitmask_failures.append(self._send_bitmask(grammar) if late else None)
        elif self.overlap == "thread":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="cadence-cpu-forward")
            self._futures.append(self._pool.submit(self._forward_and_sample, model_input))
        else:
            super().submit(model_input)

    def collect(self) -> SamplerOutput:
        if self._worker is not None:
            return self._result(
                self._bitmask_failures.popleft() if self._bitmask_failures else None)
        if self.overlap == "thread":
            return self._futures.popleft().result()
        return super().collect()

    def discard_in_flight(self) -> None:
        if self._worker is not None:
            self._bitmask_failures.clear()
            self._worker.discard_in_flight()
        elif self.overlap == "thread":
            # The one forward thread runs every step after the ones before it, so none of
            # these can write a block its next owner has written; waited for all the same,
            # so that their results are gone when the next step starts.
            futures, self._futures = list(self._futures), deque()
            for future in futures:
                with contextlib.suppress(Exception):  # a step that failed is dropped too
                    future.result()
        else:
            self._submitted.clear()  # the base class's queue (sync: computed already)

    def _send_bitmask(self, grammar: Any) -> BaseException | None:
        """Send a submitted step's bitmask. One that cannot be computed is returned, not
        raised: the worker was told and fails the step, and its reply must still be read,
        or the next step would take it for its own."""
        try:
            self._worker.send_bitmask(grammar)
        except WorkerLostError:
            raise
        except Exception as e:  # noqa: BLE001  # raised by _result, once the reply is read
            return e
        return None

    def _result(self, failure: BaseException | None) -> SamplerOutput:
        """The oldest step's reply; a step whose bitmask failed raises that error (the
        engine's own, not the worker's "no bitmask" that follows from it)."""
        try:
            out = self._worker.result()
        except WorkerLostError:
            raise
        except RuntimeError:
            if failure is not None:
                raise failure from None
            raise
        if failure is not None:
            raise failure
        return out

    @property
    def worker_pid(self) -> int | None:
        """The forward worker's process id (``process`` strategy), for operators and tests."""
        worker = self._worker
        return worker.pid if worker is not None else None

    def check_health(self, deep: bool = False) -> None:
        worker = self._worker  # read once: the engine thread may be restarting it
        if worker is not None:
            worker.check_alive()
            if deep:
                worker.ping()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._futures.clear()
        self._bitmask_failures.clear()
        self._submitted.clear()
        # Weights and the KV cache go now, not whenever the engine object is collected: a
        # process that builds engines one after another (tests, notebooks, a server that
        # restarts its engine) would otherwise hold every one's cache (2 GiB by default).
        self.runner = None

    def env_info(self) -> dict[str, str]:
        if self.overlap == "process" and not self._in_rank:
            # The worker's runtime_info carries its thread count; torch stays out of the
            # engine process, as it is in use (cadence.cpuinfo.torch_facts says why), also
            # before the worker is up, after shutdown and while it restarts.
            from cadence.cpuinfo import torch_facts

            return {"torch": str(torch_facts()["version"]), "cpu_count": str(os.cpu_count()),
                    **self.runtime_info}
        import torch

        return {"torch": torch.__version__, "cpu_threads": str(torch.get_num_threads()),
                "cpu_count": str(os.cpu_count()), **self.runtime_info}
