"""CUDA backend: the model on one NVIDIA GPU, Triton attention kernels, CUDA graphs for
decode, and the overlap strategy that runs the host's post-sample work while the GPU computes.

One step (``execute``)::

    host:   stage inputs (pinned) | replay graph | post_sample() | sample | start copy | wait
    device:                        |======= forward =======|sample|copy ids (side stream)|

Nothing here runs at import of ``cadence.backends.cuda``: this module is imported only when
the plugin registers the class, and triton only when the attention layer is first built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Protocol

import torch
from cadence.backend import (
    Backend,
    ModelInput,
    PostSample,
    ProbeResult,
    SamplerOutput,
    SamplingMetadata,
)
from cadence.backends.cuda import CudaOptions
from cadence.backends.cuda.attention import (
    TritonPagedAttention,
    build_metadata,
    sample_token_indices,
)
from cadence.backends.cuda.buffers import InputLayout, InputStager, OutputCopier, pack_inputs
from cadence.backends.cuda.graphs import (
    CudaGraphRunner,
    bucket_for,
    capture_sizes,
    pack_padded,
    pad_decode,
)
from cadence.config import EngineConfig
from cadence.model_runner import ModelRunner, PreparedInput

#: The order ``execute`` runs things in; tests compare the recorded event log with it.
OVERLAP_ORDER = ("launch", "post_sample", "sample", "copy", "sync")


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


def profile_input(max_tokens: int, max_seqs: int, max_model_len: int) -> ModelInput:
    """The largest step the scheduler can build: ``max_tokens`` prompt tokens over up to
    ``max_seqs`` sequences, every one sampled with top-p (the sort is the sampler's peak).
    Every slot is -1, so the forward writes no KV and needs no real cache."""
    num_tokens = min(max_tokens, max_seqs * max_model_len)
    num_seqs = min(max_seqs, num_tokens)
    base, extra = divmod(num_tokens, num_seqs)
    lens = [base + (i < extra) for i in range(num_seqs)]
    positions = [p for n in lens for p in range(n)]
    sampling = SamplingMetadata([1.0] * num_seqs, [0] * num_seqs, [0.9] * num_seqs,
                                [0.0] * num_seqs, [None] * num_seqs, [0] * num_seqs, False)
    return ModelInput([0] * num_tokens, positions, [-1] * num_tokens, lens, list(lens),
                      [[0]] * num_seqs, 0, list(range(num_seqs)), sampling)


class CudaBackend(Backend):
    """Runs the model on one CUDA GPU (see the module docstring)."""

    name = "cuda"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = CudaOptions.from_config(config)
        device = torch.device(self.options.device or "cuda")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.runner = ModelRunner(config, self.device)
        self.block_size = config.cache_config.block_size
        self.graphs: CudaGraphRunner | None = None
        self.dummy_block = -1
        #: "launch", "post_sample", ... per step when ``record_events`` is on (tests, debug).
        self.event_log: list[str] | None = [] if self.options.record_events else None

    @classmethod
    def probe(cls) -> ProbeResult:
        # torch is a core dependency, so importing it costs nothing extra; triton is only
        # located, never imported. torch.cuda.is_available() neither creates a CUDA context
        # nor initialises torch's CUDA state (torch.cuda.is_initialized() stays False); it
        # does call cuInit, so set PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch then asks NVML)
        # if you fork after probing. docs/backends/cuda.md says the same.
        if torch.version.cuda is None:
            return ProbeResult(False, f"torch {torch.__version__} is not a CUDA build")
        if importlib.util.find_spec("triton") is None:
            return ProbeResult(False, "triton is not installed (pip install 'cadence[cuda]')")
        if not torch.cuda.is_available():
            return ProbeResult(False, "no CUDA device is visible (driver missing or "
                               "CUDA_VISIBLE_DEVICES empty)")
        return ProbeResult(True, f"torch {torch.__version__}, CUDA {torch.version.cuda}")

    def load_model(self) -> None:
        self.runner.load_model()
        sched = self.config.scheduler_config
        self.width = -(-self.config.model_config.max_model_len // self.block_size)
        layout = InputLayout(sched.max_num_batched_tokens, sched.max_num_seqs,
                             sched.max_num_seqs, self.width)
        self.stager = InputStager(layout.size, self.device)
        self.copier = OutputCopier(self.device, sched.max_num_seqs)

    def _attention(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> TritonPagedAttention:
        return TritonPagedAttention(k, v, self.runner.kv_cache_spec().head_dim ** -0.5,
                                    self.block_size)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak allocated bytes of one forward + sampling at the largest batch."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        spec = self.runner.kv_cache_spec()
        tiny = torch.zeros(self.block_size, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                           device=self.device)  # all slots are -1: nothing is written
        self.runner.attn = self._attention([tiny] * spec.num_layers, [tiny] * spec.num_layers)
        sched, model = self.config.scheduler_config, self.config.model_config
        mi = profile_input(sched.max_num_batched_tokens, sched.max_num_seqs, model.max_model_len)
        self.to_host(self.sample(self.launch(mi), mi.sampling))
        torch.cuda.synchronize(self.device)
        self.runner.attn = None
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self) -> int:
        if self.config.cache_config.num_blocks is not None:
            num_blocks = self.runner.num_blocks_for_bytes(0)
        elif self.device.type != "cuda":
            raise ValueError("num_kv_blocks must be set when the cuda backend runs on "
                             f"{self.device} (no free-memory query there)")
        else:
            peak = self._profile_peak_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_cache_bytes(total, free, peak, torch.cuda.memory_reserved(self.device),
                                    self.options.gpu_memory_utilization)
            # One block more than the engine sees: the dummy block of graph padding rows.
            spec = self.runner.kv_cache_spec()
            num_blocks = self.runner.num_blocks_for_bytes(budget - spec.bytes_per_block)
        k, v = self.runner.allocate_kv_cache(num_blocks + 1)
        self.dummy_block = num_blocks
        self.runner.attn = self._attention(k, v)
        return num_blocks

    def warmup(self) -> None:
        if self.options.enforce_eager:
            return
        sizes = capture_sizes(self.options.cuda_graph_max_bs)
        self.graphs = CudaGraphRunner(self.runner.model, self.runner.attn, sizes, self.width,
                                      self.dummy_block, self.device)
        self.graphs.capture()

    # -- the four device steps (DeviceOps) ------------------------------------------------

    def launch(self, mi: ModelInput) -> torch.Tensor:
        """Enqueue the forward; logits [num_sampled, vocab] (graph replay when possible)."""
        bucket = None
        if self.graphs is not None and mi.is_decode_only and mi.num_seqs:
            bucket = bucket_for(mi.num_seqs, self.graphs.sizes)
            if bucket is not None and max(map(len, mi.block_tables)) > self.width:
                bucket = None  # a table wider than the static buffer: run eagerly
        if bucket is None:
            return self._launch_eager(mi)
        graphs = self.graphs
        padded = pad_decode(mi, bucket, self.dummy_block)
        self.stager.stage(graphs.layout.size_for_rows(bucket),
                          lambda a: pack_padded(a, graphs.layout, padded), dst=graphs.static)
        logits = graphs.replay(bucket)
        rows = mi.sample_seq_indices
        if rows == list(range(len(rows))):
            return logits[:len(rows)]
        return logits[torch.tensor(rows, device=self.device)]

    def _launch_eager(self, mi: ModelInput) -> torch.Tensor:
        sample_idx = sample_token_indices(mi.query_lens, mi.sample_seq_indices)
        width = max(1, max(map(len, mi.block_tables), default=1))
        layout = InputLayout(mi.num_tokens, len(sample_idx), mi.num_seqs, width)
        flat = self.stager.stage(layout.size, lambda a: pack_inputs(
            a, layout, mi.input_ids, mi.positions, mi.slot_mapping, sample_idx, mi.seq_lens,
            mi.block_tables))
        views = layout.split(flat)
        md = build_metadata(mi, views, self.block_size)
        return self.runner.run_model(PreparedInput(views.input_ids, views.positions,
                                                   views.sample_idx, md))

    def sample(self, logits: torch.Tensor, sampling: SamplingMetadata) -> Any:
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
        return execute_overlapped(self, model_input, post_sample, self.event_log)

    def shutdown(self) -> None:
        self.graphs = None
        self.runner.attn = None
        torch.cuda.empty_cache()

    def env_info(self) -> dict[str, str]:
        from importlib.metadata import version

        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "none"
        return {"torch": torch.__version__, "cuda": str(torch.version.cuda),
                "triton": version("triton"), "gpu": gpu}
