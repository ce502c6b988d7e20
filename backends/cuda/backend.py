"""CUDA backend: the model on one NVIDIA GPU, Triton attention kernels, CUDA graphs for
decode, and the overlap strategy that runs the host's post-sample work while the GPU computes.

One step (``execute``)::

    host:   stage inputs (pinned) | replay graph | post_sample() | sample | start copy | wait
    device:                        |======= forward =======|sample|copy ids (side stream)|

With async scheduling (``submit``/``collect``) a step is launched, sampled and its copy
started without waiting; its placeholders are filled from the previous step's sampled ids by
a Triton scatter on the compute stream, into the graph's static input ids before a replay
(``runtime.fill_placeholders``); ``collect`` waits on the copy's event only.

Importing this module imports no torch and no triton: it holds the host logic (the overlap
order, KV sizing, the profiling step) and the class, whose torch-side methods live in
``cadence.backends.cuda.runtime``, imported when a backend is constructed; triton is imported
only when the attention layer is first built. ``probe()`` imports neither.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from cadence.backend import (
    Backend,
    ModelInput,
    PostSample,
    ProbeResult,
    SamplerOutput,
    SamplingMetadata,
    raise_if_device_lost,
)
from cadence.backends.cuda import CudaOptions
from cadence.config import EngineConfig

# No torch here: registering and probing this backend (engine backends, engine --help) must
# not load torch, so that a plugin can still set its environment first. Everything that
# touches torch lives in ``cadence.backends.cuda.runtime``, imported by ``CudaBackend()``.
if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: The order ``execute`` runs things in; tests compare the recorded event log with it.
OVERLAP_ORDER = ("launch", "post_sample", "sample", "copy", "sync")

#: Errors after which the CUDA context refuses every later call ("sticky" in CUDA's terms;
#: torch raises them as AcceleratorError). Out of memory is not one: it fails a step only.
CUDA_STICKY_ERRORS = ("AcceleratorError", "illegal memory access", "device-side assert",
                      "unspecified launch failure", "misaligned address",
                      "illegal instruction", "uncorrectable ECC", "CUDA driver shutting down")


class DeviceOps(Protocol):
    """The four device steps the overlap strategy orders (a fake one drives CPU tests)."""

    def launch(self, model_input: ModelInput) -> Any: ...
    def sample(self, logits: Any, sampling: SamplingMetadata) -> Any: ...
    def start_copy(self, sampled: Any) -> Any: ...
    def finish_copy(self, handle: Any) -> SamplerOutput: ...


def execute_overlapped(ops: DeviceOps, model_input: ModelInput, post_sample: PostSample,
                       event_log: list[str] | None = None) -> SamplerOutput:
    """Launch -> post_sample -> sample -> copy -> sync (see the module docstring).

    ``post_sample`` runs right after the forward is enqueued: the host does the previous
    step's output work while the GPU computes. Sampling is enqueued only afterwards because
    the sampler's host-side setup (small parameter tensors) would otherwise delay it.
    """
    note: Callable[[str], None] = event_log.append if event_log is not None else _no_log
    logits = ops.launch(model_input)
    note("launch")
    post_sample()
    note("post_sample")
    sampled = ops.sample(logits, model_input.sampling)
    note("sample")
    handle = ops.start_copy(sampled)
    note("copy")
    out = ops.finish_copy(handle)
    note("sync")
    return out


def _no_log(_: str) -> None:
    pass


def kv_cache_bytes(total: int, free: int, torch_peak: int, torch_reserved: int,
                   utilization: float) -> int:
    """Bytes the KV cache may take: ``utilization`` of the whole card, minus what this process
    peaked at in the profiling forward (weights + activations) and minus memory held outside
    torch's allocator (the CUDA context, other processes), as vLLM does."""
    outside_torch = max(0, (total - free) - torch_reserved)
    budget = int(total * utilization) - torch_peak - outside_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache "
            f"(card {total >> 20} MiB, model peak {torch_peak >> 20} MiB, used outside torch "
            f"{outside_torch >> 20} MiB); raise it or use a smaller model / batch")
    return budget


def profile_input(max_tokens: int, max_seqs: int, max_model_len: int,
                  rows_per_seq: int = 1) -> ModelInput:
    """The largest step the scheduler can build: ``max_tokens`` prompt tokens over up to
    ``max_seqs`` sequences, every one sampled with top-p (the sort is the sampler's peak),
    each at its last ``rows_per_seq`` rows (1 + the speculative drafts a step may carry).
    Every slot is -1, so the forward writes no KV and needs no real cache.

    The tokens go to the first sequences first, each up to ``max_model_len``: attention
    memory grows with a prompt's length, so the profile must hold the longest prompt a step
    can carry, not ``max_tokens`` spread thinly (the KV cache takes what the profile leaves).
    """
    num_tokens = min(max_tokens, max_seqs * max_model_len)
    num_seqs = min(max_seqs, num_tokens)
    # Every sequence has at least one token, and as many as it samples rows where the
    # tokens suffice.
    base = max(1, min(rows_per_seq, num_tokens // num_seqs, max_model_len))
    lens, left = [], num_tokens - base * num_seqs
    for _ in range(num_seqs):
        extra = min(left, max_model_len - base)
        lens.append(base + extra)
        left -= extra
    positions = [p for n in lens for p in range(n)]
    # A sequence named g times samples its last g rows (ModelInput.sampled_rows).
    seqs = [i for i, n in enumerate(lens) for _ in range(min(n, rows_per_seq))]
    m = len(seqs)
    sampling = SamplingMetadata([1.0] * m, [0] * m, [0.9] * m, [0.0] * m, [None] * m,
                                [0] * m, False)
    return ModelInput([0] * num_tokens, positions, [-1] * num_tokens, lens, list(lens),
                      [[0]] * num_seqs, 0, seqs, sampling)


def _torch_version_file() -> tuple[str | None, str | None] | str:
    """(torch.__version__, torch.version.cuda) read from torch's ``version.py`` without
    importing torch; a string says why that was not possible."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "torch is not installed"
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError) as e:
        return f"cannot tell whether torch is a CUDA build (reading {path}: {e})"
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("__version__", "cuda"):
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                return (f"cannot tell whether torch is a CUDA build ({path}: "
                        f"{target.id} is not a literal)")
    if "cuda" not in found:
        return f"cannot tell whether torch is a CUDA build ({path} has no 'cuda' entry)"
    return found.get("__version__"), found["cuda"]


def _nvidia_device_missing() -> str | None:
    """Why no NVIDIA device is usable, or None; from the file system and the environment
    only (no CUDA driver call, no torch)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if first == "" or first.startswith("-"):
            return f"no NVIDIA device found (CUDA_VISIBLE_DEVICES={visible!r} hides all)"
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return None
    except OSError:
        pass
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"):  # /dev/dxg: WSL2
        return None
    return ("no NVIDIA device found (no /proc/driver/nvidia/gpus entry and no "
            "/dev/nvidia<N> node: driver not loaded or the device not passed to this "
            "container)")


def _runtime() -> ModuleType:
    from cadence.backends.cuda import runtime

    return runtime


class CudaBackend(Backend):
    """Runs the model on one CUDA GPU (see the module docstring)."""

    name = "cuda"
    # Placeholders are scattered from the last sampled ids on the device (runtime.submit).
    supports_async_scheduling = True
    # One rank per GPU (cuda:LOCAL_RANK), collectives over NCCL. Ranks run eagerly: a
    # collective inside a captured CUDA graph has not been checked on GPUs yet.
    supports_tensor_parallel = True
    # One stage per GPU, the activations between stages over NCCL send/recv; a stage before
    # the last samples nothing (``sample``). Stages run eagerly too (``warmup``).
    supports_pipeline_parallel = True
    # Prefill steps (and any step with pooled rows) run eagerly through
    # ModelRunner.run_model, which computes prompt logprobs and pooled sums; the output
    # copier brings them to the host with the samples.
    supports_prompt_logprobs = True
    supports_pooling = True
    # LoRA steps run eagerly too (launch): the graphs hold no adapter updates.
    supports_lora = True
    # Drafts' rows are not decode-only steps: they run eagerly, never a graph replay.
    supports_speculative = True
    # Compressed linears run a Triton GEMM that dequantizes a tile at a time (quant.py,
    # quant_kernels.py): 4-bit values packed two a byte where they fit, else int8.
    supports_quantization = ("gguf", "int8", "awq", "gptq", "compressed-tensors")
    distributed_backend = "nccl"
    # Under the ray executor each rank's bundle holds one GPU, which Ray makes the actor's
    # only visible device (CUDA_VISIBLE_DEVICES): the rank then takes cuda:0 (rank_device).
    ray_resources: ClassVar[dict[str, float]] = {"GPU": 1}

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = CudaOptions.from_config(config)
        self._rt = _runtime()  # imports torch, the model runner, the graphs, ...
        self.block_size = config.cache_config.block_size
        self.graphs: Any = None  # a runtime CudaGraphRunner once warmed up
        self.dummy_block = -1
        #: "launch", "post_sample", ... per step when ``record_events`` is on (tests, debug).
        self.event_log: list[str] | None = [] if self.options.record_events else None
        self._rt.init(self)  # sets self.device and self.runner
        if self.device.type != "cuda":
            # The CPU mode (a test aid) has no NCCL: its ranks meet over gloo.
            self.distributed_backend = "gloo"

    @classmethod
    def probe(cls) -> ProbeResult:
        # torch is never imported here (engine backends must not load it, so a plugin can
        # still set its environment first), and neither is triton; no CUDA call is made.
        # 1. CUDA build: torch is located with find_spec and its generated version.py is
        #    parsed (``cuda = '12.4'`` or ``cuda: Optional[str] = None``, i.e. the value
        #    torch.version.cuda would have). 2. triton: located with find_spec.
        # 3. A device: /proc/driver/nvidia/gpus has an entry or a /dev/nvidia<N> node
        #    exists (/dev/dxg on WSL2), and CUDA_VISIBLE_DEVICES does not hide every
        #    device. This cannot see a driver/toolkit mismatch or a device taken by
        #    another process; those surface when the backend is built (torch.cuda raises).
        # docs/backends/cuda.md says the same.
        info = _torch_version_file()
        if isinstance(info, str):
            return ProbeResult(False, info)
        version, cuda = info
        if cuda is None:
            return ProbeResult(False, f"torch {version} is not a CUDA build")
        if importlib.util.find_spec("triton") is None:
            return ProbeResult(False, "triton is not installed (pip install 'cadence[cuda]')")
        missing = _nvidia_device_missing()
        if missing is not None:
            return ProbeResult(False, missing)
        return ProbeResult(True, f"torch {version}, CUDA {cuda}")

    def load_model(self) -> None:
        self._rt.load_model(self)

    def allocate_kv_cache(self) -> int:
        return self._rt.allocate_kv_cache(self)

    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        super().check_parallel_config(config)
        size = config.parallel_config.world_size
        device = config.backend_option("device")
        if size == 1 or (device is not None and not str(device).startswith("cuda")):
            return
        parallel = config.parallel_config
        # Every rank of every stage (tensor x pipeline parallel) takes a GPU of its own.
        split = " x ".join(f"--{kind}-parallel-size {n}" for kind, n in (
            ("tensor", parallel.tensor_parallel_size),
            ("pipeline", parallel.pipeline_parallel_size)) if n > 1)
        if device not in (None, "cuda"):
            raise ValueError(f"{split}: each rank takes the GPU its LOCAL_RANK names; a fixed "
                             f"cuda device ({device!r}) would put every rank on one GPU")
        if parallel.executor == "mp":  # Ray's ranks may be on other hosts
            import torch

            found = torch.cuda.device_count()  # NVML: no CUDA context is created
            if found < size:
                raise ValueError(f"{split} needs {size} GPUs, one per rank; {found} visible "
                                 "(CUDA_VISIBLE_DEVICES)")

    def warmup(self) -> None:
        if self.options.enforce_eager:
            return
        if self.config.parallel_config.world_size > 1:
            # Tensor parallel: all-reduces in a captured graph are not verified on GPUs yet.
            # Pipeline parallel: a graph would need the stage's NCCL send/recv captured and
            # the received activations in a static buffer; neither is built.
            logger.info("CUDA graphs off under tensor or pipeline parallel (collectives and "
                        "point-to-point sends in captured graphs are not verified yet): "
                        "running eagerly")
            return
        if not getattr(self.runner.model, "graph_capturable", True):
            logger.info("CUDA graphs off: %s routes tokens on the host (runs eagerly)",
                        type(self.runner.model).__name__)
            return
        self._rt.warmup(self)

    # -- the four device steps (DeviceOps) ------------------------------------------------

    def launch(self, mi: ModelInput) -> torch.Tensor:
        """Enqueue the forward; logits [num_sampled, vocab] (graph replay when possible)."""
        return self._rt.launch(self, mi)

    def sample(self, logits: torch.Tensor | None, sampling: SamplingMetadata) -> Any:
        # None on a pipeline stage before the last: nothing is sampled, and the empty copy
        # behind it still waits for the stage's forward; the step returns no ids, as the
        # CPU backend's stage does.
        return self.runner.sample(logits, sampling)

    def start_copy(self, sampled: Any) -> Any:
        return self.copier.start(sampled)

    def finish_copy(self, handle: Any) -> SamplerOutput:
        return self.copier.finish(handle)

    # -- the Backend contract ---------------------------------------------------------------

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        return self.launch(model_input)

    def to_host(self, sampled: Any) -> SamplerOutput:
        return self.finish_copy(self.start_copy(sampled))

    def execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        try:
            return execute_overlapped(self, model_input, post_sample, self.event_log)
        except Exception as e:
            # Out of memory fails this step only (the engine retries it in smaller groups);
            # a sticky CUDA error poisons the context for every later step.
            raise_if_device_lost(e, CUDA_STICKY_ERRORS, "the CUDA context")
            raise

    def submit(self, model_input: ModelInput) -> None:
        try:
            self._rt.submit(self, model_input)
        except Exception as e:
            raise_if_device_lost(e, CUDA_STICKY_ERRORS, "the CUDA context")
            raise

    def collect(self) -> SamplerOutput:
        try:
            return self._rt.collect(self)
        except Exception as e:
            raise_if_device_lost(e, CUDA_STICKY_ERRORS, "the CUDA context")
            raise

    def discard_in_flight(self) -> None:
        try:
            self._rt.discard_in_flight(self)
        except Exception as e:
            raise_if_device_lost(e, CUDA_STICKY_ERRORS, "the CUDA context")
            raise

    def shutdown(self) -> None:
        self._rt.shutdown(self)

    def env_info(self) -> dict[str, str]:
        return self._rt.env_info(self)
