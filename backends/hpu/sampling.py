"""Sampling a padded HPU step: the step's parts (one graph each), per-row metadata for a
bucket's rows, the sampler call (counting for penalties the tokens that async scheduling
left on the device), and the samples read back in the engine's row order. No torch at
import time (the plugin module imports the backend before anything heavy)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cadence.backend import SamplerOutput, SamplingMetadata

__all__ = ["Part", "expand_sampling", "parts_to_host", "sample_parts"]


@dataclass(slots=True)
class Part:
    """One graph of a step: its padded batch, and which sampled row each batch row is."""

    batch: Any  # buckets.PaddedBatch
    rows: list[int | None]
    result: Any = None  # logits after forward, DeviceSample after sample
    fill: Any = None  # async scheduling: the placeholder fill (feedback.Fill)
    # Prompt logprobs: (padded token rows, target ids, top-k count) the step asks of this
    # part, then the computed tensors (core/layers/prompt_logprobs.py).
    prompt_rows: Any = None
    prompt_logprobs: Any = None
    # Embeddings: (padded first row, count) spans to pool, then their sums
    # (core/layers/pooling.py).
    pool_rows: Any = None
    pooled: Any = None


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
        bad_words_pending=pick(meta.bad_words_pending, []),
        logit_bias=pick(meta.logit_bias, {}),
        allowed_token_ids=pick(meta.allowed_token_ids, []),
        num_logprobs=pick(meta.num_logprobs, -1),
        output_placeholder_src=pick(meta.output_placeholder_src, -1),
        # A bitmask row for every batch row (all tokens for padding): shapes stay static.
        grammar=meta.grammar.select(rows) if meta.grammar is not None else None)


def sample_parts(parts: list[Any], meta: SamplingMetadata, runner: Any, device: Any,
                 sampled: Any) -> None:
    """Sample every part of a step (``part.result``: logits in, ``DeviceSample`` out).

    ``sampled`` (feedback.SampledIds, async scheduling only) supplies the previous step's
    tokens to rows with penalties, and takes this step's samples once every part is done.
    """
    from cadence.layers import sampler

    if sampled is not None:
        meta = sampled.sampling_rows(meta)
    for p in parts:
        rows_meta = expand_sampling(meta, p.rows)
        device.note_graph("sample", p.result, rows_meta.all_greedy)
        pending = None if sampled is None else sampler.pending_output_ids(
            rows_meta, sampled.buf, p.result.shape[1])
        if pending is None:
            p.result = runner.sample(p.result, rows_meta)
        else:
            p.result = sampler.sample(p.result.float(), rows_meta, runner.generator, pending,
                                      runner.draw)
    if sampled is not None:
        sampled.keep(parts)  # only now: the step itself read the previous samples


def parts_to_host(parts: list[Part], num_sampled: int) -> SamplerOutput:
    """The parts' samples on the host, each at its sampled row (waits for the device)."""
    from cadence.layers import sampler
    from cadence.layers.pooling import pooled_to_host
    from cadence.layers.prompt_logprobs import prompt_logprobs_to_host

    token_ids = [0] * num_sampled
    logprobs: list | None = None
    prompt: list | None = None
    pooled: list | None = None
    for p in parts:
        if p.prompt_logprobs is not None:
            prompt = prompt_logprobs_to_host(p.prompt_logprobs)
        if p.pooled is not None:  # the parts run in sequence order, as the spans do
            pooled = (pooled or []) + pooled_to_host(p.pooled)
        out = sampler.to_host(p.result)
        if out.logprobs is not None and logprobs is None:
            logprobs = [None] * num_sampled
        for r, j in enumerate(p.rows):
            if j is not None:
                token_ids[j] = out.sampled_token_ids[r]
                if out.logprobs is not None:
                    logprobs[j] = out.logprobs[r]
    return SamplerOutput(token_ids, logprobs, prompt_logprobs=prompt, pooled=pooled)
