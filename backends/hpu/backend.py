"""Habana Gaudi (HPU) backend: shape buckets, HPU graphs, and the lazy-mode overlap.

Overlap strategy (lazy mode, ``PT_HPU_LAZY_MODE=1``, the default): in lazy mode torch ops
only build a graph; the device starts when ``mark_step()`` is called. So one step is

    forward (HPU graph, queued) -> mark_step (device starts) -> post_sample (host work of
    the previous step, while the device runs) -> sample (queued) -> mark_step -> to_host

In eager / torch.compile mode (``PT_HPU_LAZY_MODE=0``) ops launch as they are called, so
the order is the CUDA backend's: forward -> post_sample -> sample -> to_host.

Every step is padded to a bucket (``buckets.py``) and the warmup runs every bucket, so no
graph is compiled while serving. Decodes and prefills of a step run as two graphs.

Async scheduling (``submit``/``collect``): a step is queued whole (forward, mark_step,
sample, mark_step) behind the one before it, and its placeholders are filled on the device
from a fixed-size buffer of that step's samples (``feedback.py``), at bucket shapes.

This module imports no torch at import time: the plugin registers ``HpuBackend`` and the
engine calls ``probe()`` before anything heavy is loaded. ``CADENCE_HPU_EMULATE=1`` runs all
of it on CPU tensors (a test aid, never a fallback; see docs/backends/hpu.md).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar

from cadence.backend import (
    Backend,
    ModelInput,
    PostSample,
    ProbeResult,
    SamplerOutput,
    SamplingMetadata,
    raise_if_device_lost,
)
from cadence.backends.hpu import buckets as bk
from cadence.backends.hpu.parts import BucketedSteps
from cadence.backends.hpu.sampling import (
    Part,
    expand_sampling,  # noqa: F401  (its old home)
)
from cadence.plugins import check_backend_options

if TYPE_CHECKING:
    from cadence.config import EngineConfig

EMULATE_ENV = "CADENCE_HPU_EMULATE"
# The backend_options the HPU backend reads (its --hpu-* flags put them there).
OPTION_KEYS = (*bk.RANGE_KEYS, "bucketing", "kv_cache_gb", "skip_warmup", "warmup_hidden",
               "record_events")
#: Errors of the Habana runtime after which the device serves nothing more in this process.
HPU_STICKY_ERRORS = ("Device reset", "device is not acquired", "synDeviceFailure",
                     "synStatus 26", "HPU device lost")


def emulation_requested() -> bool:
    """Whether CADENCE_HPU_EMULATE asks for the CPU emulation (read at call time)."""
    import os

    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class HpuBackend(BucketedSteps, Backend):
    """Runs the model on a Habana Gaudi (or, with CADENCE_HPU_EMULATE=1, its emulation).

    How a step becomes bucketed parts (split, run, sample, read back) and the warmup over
    every bucket come from ``BucketedSteps`` (parts.py); this class keeps the step order."""

    name = "hpu"
    # Placeholders are filled on the device from a fixed-size buffer of the last step's
    # samples, at bucket shapes (feedback.py).
    supports_async_scheduling = True
    # One rank per Gaudi card, the card chosen by the bridge from LOCAL_RANK (which the
    # executor sets before this backend is built); collectives over HCCL, or over gloo in
    # emulation.
    supports_tensor_parallel = True
    # One stage per card: each bucketed part's activations go to the next stage (padded to
    # the part's bucket, which every stage picks alike from the same ModelInput), and a
    # stage before the last samples nothing. See the NOTE at ``warmup``.
    supports_pipeline_parallel = True
    distributed_backend = "hccl"
    # A part that holds prompt-logprob or pooled rows runs a graph that also returns its
    # hidden states; the rows' logits and sums are taken from those (parts.py).
    supports_prompt_logprobs = True
    supports_pooling = True
    # Compressed linears keep their int8 values on the card and expand the weight in each
    # call (quant.py).
    supports_quantization = ("gguf", "int8", "awq", "gptq", "compressed-tensors")
    # Under the ray executor each rank's bundle holds one Gaudi card: the "HPU" resource
    # Ray detects on Gaudi nodes (vLLM asks for the same).
    ray_resources: ClassVar[dict[str, float]] = {"HPU": 1}

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_backend_options(config.backend_options, "hpu", OPTION_KEYS)
        from cadence.backends.hpu.device import make_device

        self.buckets = bk.bucket_config(config)
        self.device = make_device()
        self.lazy = self.device.lazy
        # Test aid: the overlap call order, as a list of event names (None: not recorded).
        self.event_log: list[str] | None = [] if config.backend_option("record_events") else None
        self.runner = None
        self.dummy_block = -1
        self.num_warmup_compiles = 0
        self.quantized_linears = 0  # linears run from compressed weights (quant.py)
        self._graphs: dict[str, Any] = {}
        self._warmed: set[bk.BucketShape] = set()
        self._unwarmed_seen: set[bk.BucketShape] = set()
        # Async scheduling: the last samples on the device, and the steps submitted.
        self._sampled = None
        self._in_flight: deque[tuple[list[Part], bool]] = deque()
        self._lost_samples = False

    @classmethod
    def probe(cls) -> ProbeResult:
        # find_spec only: importing the bridge would acquire the device (exclusive).
        if emulation_requested():
            return ProbeResult(True, f"emulated on the CPU ({EMULATE_ENV}=1, a test aid: no "
                                     "Gaudi is used)")
        if importlib.util.find_spec("habana_frameworks") is None:
            return ProbeResult(False, "habana_frameworks is not installed (install Intel "
                                      "Gaudi's PyTorch bridge on a Gaudi host)")
        return ProbeResult(True, "habana_frameworks found")

    def init_distributed(self, rank: int, world_size: int, init_method: str,
                         join_timeout: float) -> None:
        if self.device.is_emulated:
            # Emulated ranks share the host's cores: each takes its share of torch's pool,
            # and they meet over gloo (no HCCL without a Gaudi).
            import os

            import torch

            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // world_size))
            self.distributed_backend = "gloo"
        else:
            # Registers the "hccl" library with torch.distributed.
            import habana_frameworks.torch.distributed.hccl  # noqa: F401
        super().init_distributed(rank, world_size, init_method, join_timeout)

    def _event(self, name: str) -> None:
        if self.event_log is not None:
            self.event_log.append(name)

    def _mark_step(self) -> None:
        self._event("mark_step")
        self.device.mark_step()

    def load_model(self) -> None:
        from cadence.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, self.device.torch_device)
        if self.config.model_config.quantization is None:
            self.runner.load_model()
            return
        from cadence.backends.hpu.quant import install_quantized
        from cadence.quantization.device import drop_dense_weights

        # The dense weights never reach the card; the int8 ones do (quant.py).
        self.runner.load_model(before_move=drop_dense_weights)
        self.quantized_linears = install_quantized(self.runner.model,
                                                   self.device.torch_device)

    def allocate_kv_cache(self) -> int:
        from cadence.backends.hpu.attention import GraphedForward, HpuPagedAttention
        from cadence.backends.hpu.device import fused_sdpa
        from cadence.layers.attention import check_supported

        gb = float(self.config.backend_option(
            "kv_cache_gb", self.config.cache_config.kv_cache_memory_gb))
        num_blocks = self.runner.num_blocks_for_bytes(int(gb * (1 << 30)))
        # One extra block the scheduler never sees: padded tokens write there.
        k, v = self.runner.allocate_kv_cache(num_blocks + 1)
        self.dummy_block = num_blocks
        spec = self.runner.kv_cache_spec()
        sdpa = None if self.device.is_emulated else fused_sdpa()
        # The emulation runs every attention path the same way (exact_attention.py), over
        # keys padded to the longest sequence served.
        max_len = self.config.model_config.max_model_len
        exact_len = -(-max_len // spec.block_size) * spec.block_size \
            if self.device.is_emulated else None
        attn = HpuPagedAttention(k, v, spec.block_size, spec.head_dim ** -0.5, sdpa,
                                 exact_len)
        check_supported(attn, self.runner.model)
        self.runner.attn = attn
        # Under pipeline parallel the forward sends and receives activations: no HPU graph
        # around that (not verified on a Gaudi), plain lazy mode instead.
        capturable = self.config.parallel_config.pipeline_parallel_size == 1
        self._graphs = {kind: self.device.wrap_graph(GraphedForward(self.runner.model, attn, kind),
                                                     kind, capturable)
                        for kind in ("decode", "prefill", "prefill_ctx")}
        # Prefills whose prompt logprobs are asked for, and embedding prompts, also return
        # their hidden states; an embedding prompt's one-token remainder runs as a decode.
        self._graphs.update({
            f"{kind}+hidden": self.device.wrap_graph(
                GraphedForward(self.runner.model, attn, kind, with_hidden=True),
                f"{kind}+hidden", capturable)
            for kind in ("decode", "prefill", "prefill_ctx")})
        if self.config.plans_with_placeholders:  # not under pipeline parallel
            from cadence.backends.hpu.feedback import SampledIds

            self._sampled = SampledIds(self.buckets, self.device,
                                       self.config.scheduler_config.max_num_seqs)
        return num_blocks

    # The per-step API: forward/sample/to_host take and return the step's parts.
    def forward(self, model_input: ModelInput) -> list[Part]:
        self._event("forward")
        if self._sampled is not None:
            self._sampled.begin()
        parts = self._split(model_input)
        self._run_parts(parts)
        return parts

    def sample(self, logits: list[Part], sampling: SamplingMetadata) -> list[Part]:
        self._event("sample")
        self._sample_parts(logits, sampling)
        return logits

    def to_host(self, sampled: list[Part]) -> SamplerOutput:
        self._event("to_host")
        num_sampled = sum(j is not None for p in sampled for j in p.rows)
        return self._host_parts(sampled, num_sampled)

    def execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        try:
            return self._execute(model_input, post_sample)
        except Exception as e:
            # A device reset or a lost device fails every later step; anything else (a
            # graph that did not compile, out of memory) fails this step only.
            raise_if_device_lost(e, HPU_STICKY_ERRORS, "the HPU device")
            raise

    def submit(self, model_input: ModelInput) -> None:
        """Async scheduling: the step's forward and sampling are queued behind the step
        before it (lazy mode: two ``mark_step``), its placeholders filled from that step's
        samples on the device; ``collect`` waits for the samples."""
        try:
            parts = self.forward(model_input)
            if self.lazy:
                self._mark_step()
            self.sample(parts, model_input.sampling)
            if self.lazy:
                self._mark_step()
        except Exception as e:
            raise_if_device_lost(e, HPU_STICKY_ERRORS, "the HPU device")
            raise
        self._in_flight.append((parts, bool(model_input.placeholder_idx)))

    def collect(self) -> SamplerOutput:
        parts, has_placeholders = self._in_flight.popleft()
        if has_placeholders and self._lost_samples:
            # Its ids came from a step whose samples never arrived.
            raise RuntimeError("this step ran on the samples of a step that failed")
        try:
            out = self.to_host(parts)
        except Exception as e:
            self._lost_samples = True
            raise_if_device_lost(e, HPU_STICKY_ERRORS, "the HPU device")
            raise
        self._lost_samples = False
        return out

    def discard_in_flight(self) -> None:
        # Waited for: the device then holds nothing the next step could mistake for its own.
        while self._in_flight:
            parts, _ = self._in_flight.popleft()
            try:
                self.to_host(parts)
            except Exception as e:
                raise_if_device_lost(e, HPU_STICKY_ERRORS, "the HPU device")
                raise
        self._lost_samples = False

    def _execute(self, model_input: ModelInput, post_sample: PostSample) -> SamplerOutput:
        parts = self.forward(model_input)
        if self.lazy:
            self._mark_step()  # the device starts the forward only now
        self._event("post_sample")
        post_sample()  # host work of the previous step, while the device runs
        self.sample(parts, model_input.sampling)
        if self.lazy:
            self._mark_step()
        return self.to_host(parts)

    def shutdown(self) -> None:
        # Weights and the KV cache go with the engine, not when the object is collected.
        self.runner = None
        self._sampled = None
        self._in_flight.clear()

    def env_info(self) -> dict[str, str]:
        import torch

        info = {"torch": torch.__version__, **self.device.env_info()}
        info["hpu_warmup_compiles"] = str(self.num_warmup_compiles)
        if self.quantized_linears:
            info["hpu_quantized_linears"] = str(self.quantized_linears)
        return info
