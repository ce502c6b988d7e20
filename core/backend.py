"""The Backend contract: what a device plugin implements. No torch import here.

A backend is selected once at start-up (through pluggy, see ``cadence.plugins``); after that
the engine calls its methods directly, once per step, never through pluggy.

The data that crosses the boundary is plain host data (lists of ints and floats), so a
``ModelInput`` can be pickled to a worker process and holds no closure (vLLM #9931).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from cadence.step_io import ModelInput, SamplerOutput, SamplingMetadata

if TYPE_CHECKING:
    from cadence.config import EngineConfig

# Re-exported: the step's data types are part of the contract (cadence.step_io).
__all__ = ["Backend", "ModelInput", "PostSample", "ProbeResult", "SamplerOutput",
           "SamplingMetadata", "WorkerLostError", "raise_if_device_lost"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Whether a backend can run here, and if not, why (shown by ``engine backends``)."""

    available: bool
    reason: str = ""




class PostSample:
    """The post-sample callback handed to ``Backend.execute``.

    Call it with no arguments at most once per step, while the device is busy. It runs the
    previous step's host work (detokenization, stop strings, outputs, freeing blocks, stats).
    It never touches device tensors, so calling it between launching work and waiting for it
    is always safe. A second call raises a ``WorkerLostError`` that stops the engine: that
    is a backend bug, not any request's fault, and the step's state cannot be trusted.
    """

    __slots__ = ("_fn", "called", "caller_thread", "ended_at", "started_at")

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn
        self.called = False
        self.caller_thread: int | None = None
        #: ``time.monotonic()`` around the call (0.0 until called), for the bench breakdown.
        self.started_at = 0.0
        self.ended_at = 0.0

    def __call__(self) -> None:
        if self.called:
            # Not a step failure to pin on a request (the engine's isolation would re-run
            # the step in halves and blame one): the backend breaks the contract.
            raise WorkerLostError("post_sample called twice in one step: a bug in the "
                                  "backend's execute (it may call it once)", restartable=False)
        import threading

        self.called = True
        self.caller_thread = threading.get_ident()
        self.started_at = time.monotonic()
        try:
            if self._fn is not None:
                self._fn()
        finally:
            self.ended_at = time.monotonic()


class WorkerLostError(RuntimeError):
    """The device state is gone: the worker process died or froze, or a device error left
    the context unusable. Raised by ``Backend.execute`` or ``Backend.check_health``.

    The engine then ends every request with an error, forgets the KV cache's contents, and
    calls ``Backend.restart`` if ``restartable`` and its restart budget allow; otherwise it
    stops serving. Any *other* exception from ``execute`` means only that step failed, with
    the device state intact: the engine re-runs the step's requests in smaller groups to
    find the one that fails and ends that one alone (docs/reliability.md).

    ``interrupted``: nothing failed; the backend stopped its worker itself because an
    interrupt (Ctrl-C) cut a step's exchange with it short, leaving a message half sent or a
    reply unread that the next step would take for its own. Its restart is not counted
    against the restart budget.
    """

    def __init__(self, message: str, restartable: bool = True,
                 interrupted: bool = False) -> None:
        super().__init__(message)
        self.restartable = restartable
        self.interrupted = interrupted


def raise_if_device_lost(error: BaseException, sticky_markers: tuple[str, ...],
                         what: str) -> None:
    """Raise a non-restartable ``WorkerLostError`` from ``error`` if its message shows one of
    ``sticky_markers``: device errors after which every later call fails too (an illegal
    memory access poisons a CUDA context), so no request can be served by this process.
    Otherwise return, and the caller re-raises ``error`` as a failure of this step only.
    """
    text = f"{type(error).__name__}: {error}"
    marker = next((m for m in sticky_markers if m in text), None)
    if marker is not None:
        first = str(error).strip().splitlines()
        raise WorkerLostError(f"{what} is unusable after a device error "
                              f"({first[0] if first else marker})",
                              restartable=False) from error


class Backend(ABC):
    """Base class of every device backend (the plugin author's contract).

    Lifecycle, in order: ``probe()`` (class method, before construction) ->
    ``__init__(config)`` -> ``load_model()`` -> ``allocate_kv_cache()`` -> ``warmup()`` ->
    ``execute()`` once per engine step -> ``shutdown()``.

    What a backend may assume: ``execute`` is called from one thread, steps never overlap
    each other, and a ``ModelInput``'s block tables only name blocks below the count
    returned by ``allocate_kv_cache``.

    What it must never do: call ``post_sample`` more than once per step, call it from inside
    the forward (it must run on the host while the device works), import its device library
    at module import time or in ``probe``, or acquire the device in ``probe``.

    Failures: ``execute`` raises ``WorkerLostError`` when the device state is lost (a worker
    that died, or gave no reply within ``config.fault_config.step_timeout_s``, or a device
    error that poisons the context) and any other exception when only the step failed. A
    step that failed may be run again, whole or in parts, with the same inputs: writing the
    same K/V to the same slots again must be harmless.
    """

    #: The name users pass as ``--backend``; must match the entry-point name.
    name: ClassVar[str] = ""
    #: Whether ``submit``/``collect`` implement the placeholder protocol of async scheduling
    #: (docs/async_scheduling.md). The engine refuses ``--async-scheduling`` otherwise.
    supports_async_scheduling: ClassVar[bool] = False
    #: Whether ``execute`` computes the prompt logprobs a ``ModelInput`` asks for
    #: (``prompt_logprob_rows``) and returns them in ``SamplerOutput.prompt_logprobs``. A
    #: backend that runs ``ModelRunner.prepare``, ``run_model`` and ``sample`` gets them
    #: from those (core/layers/prompt_logprobs.py). The engine refuses requests with
    #: ``prompt_logprobs`` otherwise.
    supports_prompt_logprobs: ClassVar[bool] = False
    #: Whether the backend returns, for each span of ``ModelInput.pool_rows``, the float32
    #: sum of those token rows' final hidden states (after the model's last norm) in
    #: ``SamplerOutput.pooled``: what embedding requests read (cadence/pooling). A backend
    #: that runs ``ModelRunner.prepare``, ``run_model`` and ``sample`` gets them from those
    #: (core/layers/pooling.py). The engine refuses embedding requests otherwise.
    supports_pooling: ClassVar[bool] = False
    #: Whether the backend applies the LoRA adapters a ``ModelInput`` names (``lora_ids``,
    #: ``lora_paths``; cadence/lora). A backend that runs ``ModelRunner.load_model``,
    #: ``prepare`` and ``run_model`` eagerly gets them from those: the runner wraps the
    #: projections at load and passes each step's adapters through the forward context. A
    #: replayed graph captured without them would skip them: run such steps eagerly. The
    #: engine refuses ``enable_lora`` otherwise.
    supports_lora: ClassVar[bool] = False
    #: Whether the backend samples every row ``ModelInput.sampled_rows()`` names, several
    #: per sequence where a sequence carries draft tokens (speculative decoding,
    #: cadence/spec_decode: a sequence named ``g`` times in ``sample_seq_indices`` samples
    #: its last ``g`` rows), each with its own ``SamplingMetadata`` row. A backend whose
    #: sampling goes through ``ModelRunner.prepare`` gets it from there. The engine refuses
    #: ``speculative_config`` otherwise.
    supports_speculative: ClassVar[bool] = False
    #: The quantization methods (cadence/quantization) the backend runs, of ``gguf``,
    #: ``int8``, ``awq``, ``gptq`` and ``compressed-tensors``: the loaded model's linears
    #: carry a ``quantized`` attribute (a ``QuantizedWeight``: int8 values, fp32 group
    #: scales and offsets, the exact form of the fp32 weight beside it), and the backend
    #: runs them from it. The engine refuses a method not named here, also one a packed
    #: checkpoint (AWQ, GPTQ, compressed-tensors) names for itself.
    supports_quantization: ClassVar[tuple[str, ...]] = ()
    #: Whether several engines of this backend can serve side by side in one process, each
    #: taking its share of the machine from ``config.parallel_config`` (its rank among
    #: ``data_parallel_size`` replicas; core/data_parallel/). ``engine serve
    #: --data-parallel-size`` refuses a backend that does not declare it.
    supports_data_parallel: ClassVar[bool] = False
    #: Whether ``load_model`` builds rank ``config.parallel_config.tensor_parallel_rank``'s
    #: shard of the model when ``tensor_parallel_size`` > 1 (core/executor/). The executors
    #: refuse ``--tensor-parallel-size`` for a backend that does not declare it.
    supports_tensor_parallel: ClassVar[bool] = False
    #: Whether ``load_model`` builds stage ``config.parallel_config.pipeline_parallel_rank``'s
    #: layers when ``pipeline_parallel_size`` > 1, and ``execute`` on a stage that is not the
    #: last returns a ``SamplerOutput`` with no ids (the model hands its activations on
    #: through ``cadence.distributed``). Refused otherwise.
    supports_pipeline_parallel: ClassVar[bool] = False
    #: The torch.distributed library of the collectives between this backend's ranks
    #: ("gloo", "nccl", "hccl"), used by the default ``init_distributed``.
    distributed_backend: ClassVar[str | None] = None
    #: The Ray resources one rank needs besides its CPU, e.g. ``{"GPU": 1}``: the ``ray``
    #: executor's placement group asks for ``{"CPU": 1, **ray_resources}`` per rank, and
    #: each rank's actor for the same (core/executor/ray_placement.py). A device Ray knows
    #: ("GPU", "HPU") is then made the rank's only visible one; any other name is a custom
    #: resource the nodes must advertise (``ray start --resources``). Empty: a CPU only.
    ray_resources: ClassVar[dict[str, float]] = {}

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The default submit/collect's device results, oldest first.
        self._submitted: list[Any] = []

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Cheaply say whether this backend can run here; never acquire the device."""

    @abstractmethod
    def load_model(self) -> None:
        """Build the model from ``config.model_config`` and put its weights on the device."""

    @abstractmethod
    def allocate_kv_cache(self) -> int:
        """Allocate the paged KV cache; return the number of blocks it holds."""

    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        """Raise ValueError if this backend cannot run ``config.parallel_config`` here (too
        few devices or cores for the ranks); called in the engine's process before any rank
        starts. The default checks only that tensor and pipeline parallel are declared."""
        size = config.parallel_config.tensor_parallel_size
        if size > 1 and not (cls.supports_tensor_parallel and cls.distributed_backend):
            raise ValueError(f"--tensor-parallel-size {size}: backend {cls.name!r} does not "
                             "support tensor parallel")
        stages = config.parallel_config.pipeline_parallel_size
        if stages > 1 and not (cls.supports_pipeline_parallel and cls.distributed_backend):
            raise ValueError(f"--pipeline-parallel-size {stages}: backend {cls.name!r} does "
                             "not support pipeline parallel")

    def init_distributed(self, rank: int, world_size: int, init_method: str,
                         join_timeout: float) -> None:
        """Join the group of ``world_size`` ranks as ``rank``, before ``load_model``.

        Called by an executor in each rank's own process (core/executor/), never by the
        uniproc path. The default joins torch.distributed's ``distributed_backend`` at
        ``init_method``, giving up after ``join_timeout`` seconds, and installs its collectives for the model layers
        (``cadence.distributed``); a plugin whose collectives come from elsewhere overrides
        it and calls ``cadence.distributed.set_tensor_parallel`` (or ``set_pipeline_parallel``)
        with its own communicator.
        """
        from cadence.distributed import init_torch_distributed

        if world_size > 1 and not self.distributed_backend:
            raise ValueError(f"backend {self.name!r} declares no distributed_backend")
        init_torch_distributed(str(self.distributed_backend), rank, world_size, init_method,
                               join_timeout,
                               self.config.parallel_config.pipeline_parallel_size)

    def warmup(self) -> None:
        """Run whatever must happen before serving (graph capture, bucket compilation)."""

    @abstractmethod
    def forward(self, model_input: ModelInput) -> Any:
        """Enqueue the forward pass; return the logits of the sampled rows (device tensor).

        Asynchronous where the device allows: do not wait for the result here.
        """

    @abstractmethod
    def sample(self, logits: Any, sampling: SamplingMetadata) -> Any:
        """Sample on the device; return device-side results for ``to_host``."""

    @abstractmethod
    def to_host(self, sampled: Any) -> SamplerOutput:
        """Wait for the samples and copy them to host memory."""

    def execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        """Run one step; the overlap strategy decides when ``post_sample`` runs.

        This default is the sync strategy (forward -> sample -> to_host -> post_sample), the
        reference every other strategy must match token for token. If an override never
        calls ``post_sample``, the engine calls it after ``execute`` returns, so a naive
        backend stays correct, only without overlap.
        """
        logits = self.forward(model_input)
        sampled = self.sample(logits, model_input.sampling)
        out = self.to_host(sampled)
        post_sample()
        return out

    def submit(self, model_input: ModelInput) -> None:
        """Async scheduling: enqueue a step and return without waiting for it.

        The engine submits step N+1 before it collects step N, so at most two steps are in
        flight; they run in submission order. Step N+1's ``placeholder_idx`` input ids are
        filled from step N's sampled ids on the device (``placeholder_src`` names the rows),
        and rows with ``sampling.output_placeholder_src`` count that token as their newest
        output for penalties and ``sampling.bad_words_pending`` (the shared sampler does
        both given ``pending_output_ids``). If step N failed, a step with placeholders must fail too, never
        run on stale ids. This default runs forward and sample at once (no overlap, the
        protocol's reference); ``collect`` copies the samples to the host.
        """
        if not self.supports_async_scheduling:
            raise NotImplementedError(f"backend {self.name!r} does not support async scheduling")
        self._submitted.append(self.sample(self.forward(model_input), model_input.sampling))

    def collect(self) -> SamplerOutput:
        """Async scheduling: wait for the oldest submitted step and return its samples.

        Raises like ``execute``: ``WorkerLostError`` when the device state is gone, anything
        else when that step failed. Post-sample work is the engine's: it runs it between
        ``submit`` and ``collect``, while the device computes.
        """
        return self.to_host(self._submitted.pop(0))

    def discard_in_flight(self) -> None:
        """Drop every step submitted and not yet collected.

        Called after an interrupt (Ctrl-C) left the engine's step, once the engine has
        ended the requests of the steps in flight: their samples are not wanted, and no
        later ``collect`` may return them as its own. The engine calls it where it hands
        steps over with ``submit`` (async scheduling, the pipeline), and otherwise only on
        a backend that overrides it (one whose ``execute`` hands a step to a worker of its
        own and reads the reply later). Wait for a step still computing where the next one
        would not run after it anyway (a worker's reply must be read off its pipe). A
        backend whose exchange with its worker was cut short raises
        ``WorkerLostError(..., interrupted=True)``, and the engine restarts it. The default
        empties the default ``submit``'s queue; a backend that overrides ``submit`` without
        overriding this is restarted, since what it holds is unknown here.
        """
        if type(self).submit is not Backend.submit:
            raise WorkerLostError(f"a step was interrupted, and backend {self.name!r} names "
                                  "no way to drop the steps it holds (discard_in_flight); "
                                  "it is restarted", interrupted=True)
        self._submitted.clear()

    def check_health(self, deep: bool = False) -> None:
        """Raise ``WorkerLostError`` if the device or its worker is known to be gone.

        ``deep=False`` must be cheap and safe to call from any thread while a step runs (a
        server's ``/health`` calls it). ``deep=True`` comes only from the engine's own
        thread while it is idle, between steps: a backend may then talk to its worker (a
        ping within the step deadline finds one that froze while nothing ran). The default
        knows of no failure outside ``execute``.
        """

    def restart(self) -> int:
        """Rebuild after a ``WorkerLostError``; return the KV cache's block count.

        The default tears everything down and goes through the start-up lifecycle again,
        which suits a backend whose worker can simply be started anew. A backend that
        cannot recover in this process raises ``WorkerLostError(..., restartable=False)``
        from ``execute`` instead.
        """
        self.shutdown()
        self.load_model()
        num_blocks = self.allocate_kv_cache()
        self.warmup()
        return num_blocks

    def shutdown(self) -> None:
        """Release the device, any worker threads or processes, and the weights and KV cache
        (drop the references): a process may build one engine after another."""

    def env_info(self) -> dict[str, str]:
        """Versions and device facts for bug reports and benchmark JSON."""
        return {}
