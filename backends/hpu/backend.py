"""Habana Gaudi (HPU) backend: shape buckets, HPU graphs, and the lazy-mode overlap.

Overlap strategy (lazy mode, ``PT_HPU_LAZY_MODE=1``, the default): in lazy mode torch ops
only build a graph; the device starts when ``mark_step()`` is called. So one step is

    forward (HPU graph, queued) -> mark_step (device starts) -> post_sample (host work of
    the previous step, while the device runs) -> sample (queued) -> mark_step -> to_host

In eager / torch.compile mode (``PT_HPU_LAZY_MODE=0``) ops launch as they are called, so
the order is the CUDA backend's: forward -> post_sample -> sample -> to_host.

Every step is padded to a bucket (``buckets.py``) and the warmup runs every bucket, so no
graph is compiled while serving. Decodes and prefills of a step run as two graphs.

This module imports no torch at import time: the plugin registers ``HpuBackend`` and the
engine calls ``probe()`` before anything heavy is loaded. ``CADENCE_HPU_EMULATE=1`` runs all
of it on CPU tensors (a test aid, never a fallback; see docs/backends/hpu.md).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from cadence.config import EngineConfig

logger = logging.getLogger(__name__)

EMULATE_ENV = "CADENCE_HPU_EMULATE"
#: Errors of the Habana runtime after which the device serves nothing more in this process.
HPU_STICKY_ERRORS = ("Device reset", "device is not acquired", "synDeviceFailure",
                     "synStatus 26", "HPU device lost")


def emulation_requested() -> bool:
    """Whether CADENCE_HPU_EMULATE asks for the CPU emulation (read at call time)."""
    import os

    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def expand_sampling(meta: SamplingMetadata, rows: list[int | None]) -> SamplingMetadata:
    """Per-row metadata for a padded batch: ``rows[r]`` is the sampled row of ``meta`` that
    batch row r carries, or None for a row nobody reads (padding, unfinished prefill chunk),
    which gets greedy defaults; its sample is dropped."""
    def pick(values: list, default: Any, optional: bool = True) -> list:
        # Optional fields stay empty when unused: the sampler skips their work then.
        if optional and not values:
            return []
        return [values[j] if j is not None else default for j in rows]

    return replace(
        meta, temperature=pick(meta.temperature, 0.0, False), top_k=pick(meta.top_k, 0, False),
        top_p=pick(meta.top_p, 1.0, False), min_p=pick(meta.min_p, 0.0, False),
        seeds=pick(meta.seeds, None, False), output_lens=pick(meta.output_lens, 0, False),
        presence_penalty=pick(meta.presence_penalty, 0.0),
        frequency_penalty=pick(meta.frequency_penalty, 0.0),
        repetition_penalty=pick(meta.repetition_penalty, 1.0),
        prompt_token_ids=pick(meta.prompt_token_ids, []),
        output_token_ids=pick(meta.output_token_ids, []),
        banned_token_ids=pick(meta.banned_token_ids, []),
        num_logprobs=pick(meta.num_logprobs, -1))


@dataclass(slots=True)
class _Part:
    """One graph of a step: its padded batch, and which sampled row each batch row is."""

    batch: bk.PaddedBatch
    rows: list[int | None]
    result: Any = None  # logits after forward, DeviceSample after sample


class HpuBackend(Backend):
    """Runs the model on a Habana Gaudi (or, with CADENCE_HPU_EMULATE=1, its emulation)."""

    name = "hpu"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from cadence.backends.hpu.device import make_device

        self.buckets = bk.bucket_config(config)
        self.device = make_device()
        self.lazy = self.device.lazy
        # Test aid: the overlap call order, as a list of event names (None: not recorded).
        self.event_log: list[str] | None = [] if config.backend_option("record_events") else None
        self.runner = None
        self.dummy_block = -1
        self.num_warmup_compiles = 0
        self._graphs: dict[str, Any] = {}
        self._warmed: set[bk.BucketShape] = set()
        self._unwarmed_seen: set[bk.BucketShape] = set()

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

    def _event(self, name: str) -> None:
        if self.event_log is not None:
            self.event_log.append(name)

    def _mark_step(self) -> None:
        self._event("mark_step")
        self.device.mark_step()

    def load_model(self) -> None:
        from cadence.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, self.device.torch_device)
        self.runner.load_model()

    def allocate_kv_cache(self) -> int:
        from cadence.backends.hpu.attention import GraphedForward, HpuPagedAttention
        from cadence.backends.hpu.device import fused_sdpa

        gb = float(self.config.backend_option(
            "kv_cache_gb", self.config.cache_config.kv_cache_memory_gb))
        num_blocks = self.runner.num_blocks_for_bytes(int(gb * (1 << 30)))
        # One extra block the scheduler never sees: padded tokens write there.
        k, v = self.runner.allocate_kv_cache(num_blocks + 1)
        self.dummy_block = num_blocks
        spec = self.runner.kv_cache_spec()
        sdpa = None if self.device.is_emulated else fused_sdpa()
        attn = HpuPagedAttention(k, v, spec.block_size, spec.head_dim ** -0.5, sdpa)
        self.runner.attn = attn
        self._graphs = {kind: self.device.wrap_graph(GraphedForward(self.runner.model, attn, kind),
                                                     kind)
                        for kind in ("decode", "prefill", "prefill_ctx")}
        return num_blocks

    def warmup(self) -> None:
        """Run every bucket, largest first, and remember the compiled-graph count."""
        if self.config.backend_option("skip_warmup"):
            logger.warning("HPU warmup skipped: graphs will compile while serving")
            return
        plan = bk.warmup_plan(self.buckets)
        # Greedy and plain random sampling; top-k/top-p, penalties, seeds and logprobs add
        # ops and compile on first use (docs/backends/hpu.md).
        metas = [SamplingMetadata([], [], [], [], [], [], all_greedy=greedy)
                 for greedy in (True, False)]
        for shape in plan:
            for meta in metas:
                part = _Part(bk.dummy_batch(shape, self.dummy_block, self.buckets.block_size),
                             [None] * shape.batch_size)
                self._run_parts([part])
                self.device.mark_step()
                self._sample_parts([part], meta)
                self.device.mark_step()
                self._host_parts([part], 0)
        self._warmed = set(plan)
        self.num_warmup_compiles = self.device.num_compiles()
        logger.info("HPU warmup: %d bucket shapes, %d graphs compiled", len(plan),
                    self.num_warmup_compiles)

    def recompiles_after_warmup(self) -> int:
        return self.device.num_compiles() - self.num_warmup_compiles

    def _split(self, mi: ModelInput) -> list[_Part]:
        slot_of = {seq: j for j, seq in enumerate(mi.sample_seq_indices)}
        parts = []
        for kind, seqs in (("decode", range(mi.num_decodes)),
                           ("prefill", range(mi.num_decodes, mi.num_seqs))):
            if not seqs:
                continue
            shape = bk.bucket_for(self.buckets, mi, seqs, kind)
            if self._warmed and shape not in self._warmed and shape not in self._unwarmed_seen:
                self._unwarmed_seen.add(shape)
                logger.warning("HPU shape %s was not warmed up: compiling it now; widen the "
                               "bucket ranges to cover it", shape)
            batch = bk.pad_batch(mi, seqs, shape, self.dummy_block, self.buckets.block_size)
            rows = [slot_of.get(seqs[r]) if r < len(seqs) else None
                    for r in range(shape.batch_size)]
            parts.append(_Part(batch, rows))
        return parts

    def _run_parts(self, parts: list[_Part]) -> None:
        import torch

        from cadence.backends.hpu.attention import graph_kind, to_tensors

        with torch.inference_mode():
            for p in parts:
                args = to_tensors(p.batch, self.device.torch_device)
                p.result = self._graphs[graph_kind(p.batch)](*args)

    def _sample_parts(self, parts: list[_Part], meta: SamplingMetadata) -> None:
        for p in parts:
            rows_meta = expand_sampling(meta, p.rows)
            self.device.note_graph("sample", p.result, rows_meta.all_greedy)
            p.result = self.runner.sample(p.result, rows_meta)

    def _host_parts(self, parts: list[_Part], num_sampled: int) -> SamplerOutput:
        from cadence.layers import sampler

        token_ids = [0] * num_sampled
        logprobs: list | None = None
        for p in parts:
            out = sampler.to_host(p.result)  # waits for the device
            if out.logprobs is not None and logprobs is None:
                logprobs = [None] * num_sampled
            for r, j in enumerate(p.rows):
                if j is not None:
                    token_ids[j] = out.sampled_token_ids[r]
                    if out.logprobs is not None:
                        logprobs[j] = out.logprobs[r]
        return SamplerOutput(token_ids, logprobs)

    # The per-step API: forward/sample/to_host take and return the step's parts.
    def forward(self, model_input: ModelInput) -> list[_Part]:
        self._event("forward")
        parts = self._split(model_input)
        self._run_parts(parts)
        return parts

    def sample(self, logits: list[_Part], sampling: SamplingMetadata) -> list[_Part]:
        self._event("sample")
        self._sample_parts(logits, sampling)
        return logits

    def to_host(self, sampled: list[_Part]) -> SamplerOutput:
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

    def env_info(self) -> dict[str, str]:
        import torch

        info = {"torch": torch.__version__, **self.device.env_info()}
        info["hpu_warmup_compiles"] = str(self.num_warmup_compiles)
        return info
