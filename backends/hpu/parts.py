"""How the HPU backend runs a step: as bucketed parts on the device.

A step splits into its decodes and its prefills; each part is padded to a bucket
(``buckets.py``), run through its kind's graph, sampled on the device, and read back. The
warmup runs every bucket once this way, so no graph compiles while serving. ``HpuBackend``
takes these methods from ``BucketedSteps``; its own module keeps the Backend contract's
step order (when ``mark_step`` starts the device, where ``post_sample`` runs).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cadence.backend import ModelInput, SamplerOutput, SamplingMetadata
from cadence.backends.hpu import buckets as bk
from cadence.backends.hpu.sampling import Part

if TYPE_CHECKING:
    from cadence.config import EngineConfig

logger = logging.getLogger(__name__)


class BucketedSteps:
    """The bucketed-parts half of ``HpuBackend`` (a mixin: it reads the backend's config,
    device, runner, buckets, graphs and sampled-ids buffer)."""

    config: EngineConfig
    device: Any
    runner: Any
    buckets: bk.BucketConfig
    dummy_block: int
    num_warmup_compiles: int
    _graphs: dict[str, Any]
    _warmed: set[bk.BucketShape]
    _unwarmed_seen: set[bk.BucketShape]
    _sampled: Any

    def warmup(self) -> None:
        """Run every bucket, largest first, and remember the compiled-graph count.

        NOTE pipeline parallel: every stage runs the same plan in the same order, so each
        stage's warmup forwards receive the previous stage's in lockstep (as TP ranks meet
        in their collectives); ``skip_warmup`` therefore applies to the whole engine.
        """
        if self.config.backend_option("skip_warmup"):
            logger.warning("HPU warmup skipped: graphs will compile while serving")
            return
        from cadence.backends.hpu.feedback import Fill

        plan = bk.warmup_plan(self.buckets)
        # Greedy and plain random sampling; top-k/top-p, penalties, seeds and logprobs add
        # ops and compile on first use (docs/backends/hpu.md).
        metas = [SamplingMetadata([], [], [], [], [], [], all_greedy=greedy)
                 for greedy in (True, False)]
        # The graphs that also return hidden states (a part with prompt-logprob or pooled
        # rows) double the compiles; only when asked.
        hidden = (False, True) if self.config.backend_option("warmup_hidden") else (False,)
        for shape in plan:
            for meta, with_hidden in ((m, h) for m in metas for h in hidden):
                batch = bk.dummy_batch(shape, self.dummy_block, self.buckets.block_size)
                part = Part(batch, [None] * shape.batch_size,
                            pool_rows=[(0, 1)] if with_hidden else None)
                if self._sampled is not None:  # the placeholder fill compiles here too
                    part.fill = Fill.nothing(shape.num_tokens)
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

    def _split(self, mi: ModelInput) -> list[Part]:
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
            fill = None if self._sampled is None else self._sampled.fill_for(mi, seqs, batch)
            parts.append(Part(batch, rows, fill=fill,
                              prompt_rows=_padded_prompt_rows(mi, seqs, shape.query_len),
                              pool_rows=_padded_pool_rows(mi, seqs, shape.query_len)))
        return parts

    def _run_parts(self, parts: list[Part]) -> None:
        import torch

        from cadence.backends.hpu.attention import graph_kind, to_tensors
        from cadence.layers.pooling import pooled_sums
        from cadence.layers.prompt_logprobs import compute_prompt_logprobs

        with torch.inference_mode():
            for p in parts:
                args = to_tensors(p.batch, self.device.torch_device)
                if p.fill is not None:
                    args = (self._sampled.apply(args[0], p.fill), *args[1:])
                if p.prompt_rows is None and p.pool_rows is None:
                    p.result = self._graphs[graph_kind(p.batch)](*args)
                    continue
                out = self._graphs[graph_kind(p.batch) + "+hidden"](*args)
                p.result = out if out is None else out[0]
                if out is None:
                    continue
                if p.prompt_rows is not None:
                    rows, targets, k = p.prompt_rows
                    dev = self.device.torch_device
                    p.prompt_logprobs = compute_prompt_logprobs(
                        self.runner.model.compute_logits, out[1],
                        torch.tensor(rows, dtype=torch.int64).to(dev),
                        torch.tensor(targets, dtype=torch.int64).to(dev), k)
                if p.pool_rows is not None:
                    p.pooled = pooled_sums(out[1], p.pool_rows)

    @property
    def _is_last_stage(self) -> bool:
        """Whether this process computes logits (always, without pipeline parallel)."""
        return getattr(self.runner.model, "is_last_stage", True)

    def _sample_parts(self, parts: list[Part], meta: SamplingMetadata) -> None:
        from cadence.backends.hpu.sampling import sample_parts

        if not self._is_last_stage:
            return  # no logits here: the parts' activations went to the next stage
        sample_parts(parts, meta, self.runner, self.device, self._sampled)

    def _host_parts(self, parts: list[Part], num_sampled: int) -> SamplerOutput:
        from cadence.backends.hpu.sampling import parts_to_host

        if not self._is_last_stage:
            # What the CPU backend's stage returns: no ids. The step ends once the stage's
            # work is done, as the last stage's does when it reads its samples.
            self.device.synchronize()
            return SamplerOutput([])
        return parts_to_host(parts, num_sampled)


def _padded_prompt_rows(mi: ModelInput, seqs: range, query_len: int
                        ) -> tuple[list[int], list[int], int] | None:
    """The step's prompt-logprob rows that fall in ``seqs``, as rows of their padded batch,
    with their targets and top-k count; None when there are none."""
    if not mi.prompt_logprob_rows or not seqs:
        return None
    at = bk.padded_rows(mi, seqs, query_len, mi.prompt_logprob_rows)
    kept = [(k, t) for k, t in zip(at, mi.prompt_logprob_targets) if k is not None]
    if not kept:
        return None
    return [k for k, _ in kept], [t for _, t in kept], max(mi.num_prompt_logprobs, 0)


def _padded_pool_rows(mi: ModelInput, seqs: range, query_len: int
                      ) -> list[tuple[int, int]] | None:
    """The step's pooled spans that fall in ``seqs``, as (first row, count) of their padded
    batch (a span's rows stay contiguous there); None when there are none."""
    if not mi.pool_rows or not seqs:
        return None
    at = bk.padded_rows(mi, seqs, query_len, [a for a, _ in mi.pool_rows])
    kept = [(k, c) for k, (_, c) in zip(at, mi.pool_rows) if k is not None]
    return kept or None
