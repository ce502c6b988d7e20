"""The torch side of ``CudaBackend``: every method of the backend that touches torch, the
model runner, the staging buffers or the graphs lives here as a function of the backend.

``backend.py`` imports this module only when a backend is constructed, so registering and
probing the backend (``engine backends``, ``engine --help``) never imports torch.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import TYPE_CHECKING

import torch

from cadence.backends.cuda.attention import TritonPagedAttention, build_metadata
from cadence.backends.cuda.buffers import InputLayout, InputStager, OutputCopier, pack_inputs
from cadence.backends.cuda.graphs import (
    CudaGraphRunner,
    bucket_for,
    capture_sizes,
    pack_padded,
    pad_decode,
)
from cadence.backends.cuda.moe import install_fused_moe
from cadence.backends.cuda.quant import drop_dense_weights, install_quantized
from cadence.layers import sampler
from cadence.layers.attention import check_supported
from cadence.layers.sampler import host_tensor
from cadence.model_runner import ModelRunner, PreparedInput, prompt_logprob_tensors
from cadence.quantization.checkpoint import method_label

if TYPE_CHECKING:
    from cadence.backend import ModelInput, SamplerOutput, SamplingMetadata
    from cadence.backends.cuda.backend import CudaBackend

logger = logging.getLogger(__name__)


def rank_device(local_rank: int, num_visible: int, rank: object = "?") -> int:
    """The index of the GPU a rank takes among the ``num_visible`` it can see: its
    ``local_rank`` (its index among its host's ranks) when every GPU of the host is visible
    (the ``mp`` executor), and the only one when one is visible (the ``ray`` executor: Ray
    gives each rank's actor one GPU through CUDA_VISIBLE_DEVICES, whatever its local rank).
    ValueError when the rank has no GPU of its own."""
    if num_visible == 1:
        return 0
    if not 0 <= local_rank < num_visible:
        raise ValueError(f"rank {rank} is rank {local_rank} on its host, which has "
                         f"{num_visible} visible GPUs")
    return local_rank


def init(be: CudaBackend) -> None:
    """Resolve the device and build the model runner (the torch half of ``__init__``)."""
    device = torch.device(be.options.device or "cuda")
    if device.type == "cuda":
        if device.index is None and be.config.parallel_config.world_size > 1:
            # A rank of tensor or pipeline parallel (LOCAL_RANK set by the executor before
            # this backend was built).
            device = torch.device("cuda", rank_device(int(os.environ.get("LOCAL_RANK", "0")),
                                                      torch.cuda.device_count(),
                                                      os.environ.get("RANK", "?")))
        elif device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        # Triton launches on the *current* device whatever the tensors' device, and the
        # graph capture, side streams and events below use it too: "cuda:1" with device 0
        # current would launch the kernels on the wrong GPU.
        torch.cuda.set_device(device)
    be.device = device
    be.runner = ModelRunner(be.config, device)
    be.quantized_linears = ""  # what runs on compressed weights, for env_info
    # Async scheduling: the last submitted step's sampled ids (device; None while a step
    # runs and after one failed), and the steps submitted, oldest first.
    be.last_sampled = None
    be.in_flight = deque()
    be.lost_samples = False


def load_model(be: CudaBackend) -> None:
    quantized = be.config.model_config.quantization is not None
    be.runner.load_model(before_move=drop_dense_weights if quantized else None)
    if quantized:
        bits = install_quantized(be.runner.model, be.device)
        be.quantized_linears = ", ".join(f"{n} at {b} bits" for b, n in sorted(bits.items()))
        logger.info("%s weights: %s linears run compressed (Triton kernel)",
                    method_label(be.config.model_config.quantization),
                    be.quantized_linears or "no")
    # Mixture-of-experts layers run the fused Triton kernels here (the CPU path keeps the
    # core's expert loop).
    install_fused_moe(be.runner.model)
    sched = be.config.scheduler_config
    be.width = -(-be.config.model_config.max_model_len // be.block_size)
    layout = InputLayout(sched.max_num_batched_tokens, sched.max_num_seqs,
                         sched.max_num_seqs, be.width)
    be.stager = InputStager(layout.size, be.device)
    be.copier = OutputCopier(be.device, sched.max_num_seqs)


def attention(be: CudaBackend, k: list[torch.Tensor],
              v: list[torch.Tensor]) -> TritonPagedAttention:
    attn = TritonPagedAttention(k, v, be.runner.kv_cache_spec().head_dim ** -0.5,
                                be.block_size)
    check_supported(attn, be.runner.model)  # a soft-capped model is refused here
    return attn


def profile_peak_bytes(be: CudaBackend) -> int:
    """Peak allocated bytes of one forward + sampling at the largest batch."""
    from cadence.backends.cuda.backend import profile_input

    with torch.inference_mode():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(be.device)
        spec = be.runner.kv_cache_spec()
        tiny = torch.zeros(be.block_size, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                           device=be.device)  # all slots are -1: nothing is written
        be.runner.attn = attention(be, [tiny] * spec.num_layers, [tiny] * spec.num_layers)
        sched, model = be.config.scheduler_config, be.config.model_config
        spec = be.config.speculative_config
        mi = profile_input(sched.max_num_batched_tokens, sched.max_num_seqs,
                           model.max_model_len,
                           1 + (spec.num_speculative_tokens if spec is not None else 0))
        be.to_host(be.sample(be.launch(mi), mi.sampling))
        torch.cuda.synchronize(be.device)
        be.runner.attn = None
        peak = torch.cuda.max_memory_allocated(be.device)
        torch.cuda.empty_cache()
    return peak


def allocate_kv_cache(be: CudaBackend) -> int:
    from cadence.backends.cuda.backend import kv_cache_bytes

    if be.config.cache_config.num_blocks is not None:
        num_blocks = be.runner.num_blocks_for_bytes(0)
    elif be.device.type != "cuda":
        raise ValueError("num_kv_blocks must be set when the cuda backend runs on "
                         f"{be.device} (no free-memory query there)")
    else:
        peak = profile_peak_bytes(be)
        free, total = torch.cuda.mem_get_info(be.device)
        budget = kv_cache_bytes(total, free, peak, torch.cuda.memory_reserved(be.device),
                                be.options.gpu_memory_utilization)
        # One block more than the engine sees: the dummy block of graph padding rows.
        spec = be.runner.kv_cache_spec()
        num_blocks = be.runner.num_blocks_for_bytes(budget - spec.bytes_per_block)
    k, v = be.runner.allocate_kv_cache(num_blocks + 1)
    be.dummy_block = num_blocks
    be.runner.attn = attention(be, k, v)
    return num_blocks


def warmup(be: CudaBackend) -> None:
    # No decode batch has more rows than max_num_seqs: a larger bucket would only cost capture
    # time and graph memory (an explicit --cuda-graph-max-bs is not capped by the default).
    max_bs = min(be.options.cuda_graph_max_bs, be.config.scheduler_config.max_num_seqs)
    sizes = capture_sizes(max_bs)
    be.graphs = CudaGraphRunner(be.runner.model, be.runner.attn, sizes, be.width,
                                be.dummy_block, be.device)
    be.graphs.capture()


def ensure_current_device(be: CudaBackend) -> None:
    """Make the backend's device current in the calling thread.

    NOTE the current device is per thread: ``init`` set it in the thread that built the
    engine, but ``AsyncLLM`` steps the engine from its own thread, which starts on device 0.
    """
    if be.device.type == "cuda" and torch.cuda.current_device() != be.device.index:
        torch.cuda.set_device(be.device)


def launch(be: CudaBackend, mi: ModelInput, previous: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Enqueue the forward; logits [num_sampled, vocab] (graph replay when possible).
    ``previous``: the last step's sampled ids, for ``mi``'s placeholders (async scheduling)."""
    ensure_current_device(be)
    be.last_sampled = None  # valid again only once a submitted step has sampled
    # A failed step's prompt outputs, never a graph replay's.
    be.runner.attach_prompt_outputs(sampler.DeviceSample(None))
    bucket = None
    # A pooled row is a hidden state the captured graphs do not return: such a step (a
    # one-token remainder of an embedding prompt counts as a decode) runs eagerly. So does
    # a step with LoRA adapters: the graphs were captured without their updates.
    if be.graphs is not None and mi.is_decode_only and mi.num_seqs and not mi.pool_rows \
            and not mi.lora_ids:
        bucket = bucket_for(mi.num_seqs, be.graphs.sizes)
        if bucket is not None and max(map(len, mi.block_tables)) > be.width:
            bucket = None  # a table wider than the static buffer: run eagerly
    if bucket is None:
        return launch_eager(be, mi, previous)
    graphs = be.graphs
    padded = pad_decode(mi, bucket, be.dummy_block)
    be.stager.stage(graphs.layout.size_for_rows(bucket),
                    lambda a: pack_padded(a, graphs.layout, padded), dst=graphs.static)
    # Into the graph's static input ids, after the staged copy and before the replay, on
    # the same stream: the captured graph reads them as it reads every staged input.
    fill_placeholders(be, graphs.views.input_ids, mi, previous)
    logits = graphs.replay(bucket)
    rows = mi.sample_seq_indices
    if rows == list(range(len(rows))):
        return logits[:len(rows)]
    return logits[host_tensor(rows, torch.int64, be.device)]  # pinned: no wait on the stream


def launch_eager(be: CudaBackend, mi: ModelInput, previous: torch.Tensor | None = None
                 ) -> torch.Tensor:
    sample_idx = mi.sampled_rows()
    width = max(1, max(map(len, mi.block_tables), default=1))
    layout = InputLayout(mi.num_tokens, len(sample_idx), mi.num_seqs, width)
    flat = be.stager.stage(layout.size, lambda a: pack_inputs(
        a, layout, mi.input_ids, mi.positions, mi.slot_mapping, sample_idx, mi.seq_lens,
        mi.block_tables))
    views = layout.split(flat)
    fill_placeholders(be, views.input_ids, mi, previous)
    md = build_metadata(mi, views, be.block_size)
    lora = be.runner.lora.step(mi) if be.runner.lora is not None else None
    return be.runner.run_model(PreparedInput(views.input_ids, views.positions,
                                             views.sample_idx, md,
                                             prompt_logprob_tensors(mi, be.device),
                                             mi.pool_rows or None, lora))


def fill_placeholders(be: CudaBackend, input_ids: torch.Tensor, mi: ModelInput,
                      previous: torch.Tensor | None) -> None:
    """Async scheduling: replace ``mi``'s placeholder input ids with the previous step's
    sampled ids, with the Triton scatter kernel on the compute stream (no host sync: the
    index lists go through pinned memory, the ids never leave the device)."""
    if not mi.placeholder_idx:
        return
    if previous is None:
        raise RuntimeError("a step planned on the previous step's samples runs after a step "
                           "that produced none (it failed): refusing stale token ids")
    from cadence.backends.cuda.triton_kernels import scatter_sampled

    scatter_sampled(input_ids, host_tensor(mi.placeholder_idx, torch.int64, be.device),
                    host_tensor(mi.placeholder_src, torch.int64, be.device), previous)


def sample(be: CudaBackend, logits: torch.Tensor, meta: SamplingMetadata,
           previous: torch.Tensor | None) -> sampler.DeviceSample:
    """Sample; rows with penalties count their token still on the device (``previous``,
    the last step's sampled ids) as their newest output (async scheduling)."""
    pending = sampler.pending_output_ids(meta, previous, logits.shape[1]) \
        if logits.shape[0] else None
    if pending is None:
        return be.runner.sample(logits, meta)
    out = sampler.sample(logits.float(), meta, be.runner.generator, pending, be.runner.draw)
    return be.runner.attach_prompt_outputs(out)


def submit(be: CudaBackend, mi: ModelInput) -> None:
    """Async scheduling: enqueue launch, sampling and the side-stream copy of the samples,
    and return. Nothing here waits for the device: placeholders are filled from the
    previous step's ids on the compute stream, and the copy's event is waited on by
    ``collect`` (the copier's double buffer is free: the step that last used it was
    collected before this one was submitted)."""
    note = be.event_log.append if be.event_log is not None else _no_note
    previous = be.last_sampled
    logits = launch(be, mi, previous)
    note("launch")
    sampled = sample(be, logits, mi.sampling, previous)
    note("sample")
    be.in_flight.append((be.copier.start(sampled), bool(mi.placeholder_idx)))
    note("copy")
    be.last_sampled = sampled.token_ids


def collect(be: CudaBackend) -> SamplerOutput:
    """Wait for the oldest submitted step's copy (its event only) and return its samples."""
    handle, has_placeholders = be.in_flight.popleft()
    if has_placeholders and be.lost_samples:
        raise RuntimeError("this step ran on the samples of a step that failed")
    try:
        out = be.copier.finish(handle)
    except Exception:
        be.lost_samples = True
        raise
    be.lost_samples = False
    if be.event_log is not None:
        be.event_log.append("sync")
    return out


def discard_in_flight(be: CudaBackend) -> None:
    """Wait for each step in flight (its copy's event) and drop its samples, so the copier's
    buffers are free again for the next submit."""
    while be.in_flight:
        handle, _ = be.in_flight.popleft()
        be.copier.finish(handle)
    be.lost_samples = False


def _no_note(_: str) -> None:
    pass


def shutdown(be: CudaBackend) -> None:
    be.in_flight.clear()
    be.last_sampled = None
    be.graphs = None
    be.runner.attn = None
    torch.cuda.empty_cache()


def env_info(be: CudaBackend) -> dict[str, str]:
    from importlib.metadata import version

    gpu = torch.cuda.get_device_name(be.device) if be.device.type == "cuda" else "none"
    info = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
            "triton": version("triton"), "gpu": gpu}
    if be.quantized_linears:
        info["cuda_quantized_linears"] = be.quantized_linears
    return info
