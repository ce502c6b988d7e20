"""The ``ModelInput`` of a step planned while the step before it is in flight. No torch.

A request that the step in flight samples has one placeholder: its newest token, which the
backend fills on the device from that step's sampled ids. This module says where each
placeholder sits in ``input_ids`` and which sampled row fills it, and gives the sampler the
same for penalties (docs/async_scheduling.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cadence.backend import ModelInput
from cadence.input_builder import build_model_input
from cadence.step_plan import StepPlan

if TYPE_CHECKING:
    from cadence.scheduling.loop import InFlightStep


def build_async_input(plan: StepPlan, in_flight: Sequence[InFlightStep], engine: Any
                      ) -> ModelInput:
    mi = build_model_input(plan, engine.block_manager.get_block_table,
                           engine.config.cache_config.block_size)
    # A constrained request is never planned around a placeholder (AsyncScheduler), so its
    # grammar has seen every token it had when this step is sampled.
    mi.sampling.grammar = engine.structured.bitmask_for(
        [plan.scheduled[i].request for i in mi.sample_seq_indices])
    if not in_flight:
        return mi
    # Only the newest step in flight can have placeholders: the one before it was committed
    # before this one was advanced.
    rows = in_flight[-1].rows
    idx: list[int] = []
    src: list[int] = []
    offset = 0
    for sr in plan.scheduled:
        req = sr.request
        if req.num_output_placeholders:
            pos = req.num_tokens - 1
            start = req.num_computed_tokens
            if start <= pos < start + sr.num_new_tokens:
                idx.append(offset + pos - start)
                src.append(rows[id(req)])
        offset += sr.num_new_tokens
    mi.placeholder_idx, mi.placeholder_src = idx, src
    meta = mi.sampling
    if idx and (meta.has_penalties or meta.bad_words_pending):
        sampled = [plan.scheduled[s].request for s in mi.sample_seq_indices]
        # Copies: a backend may sample on another thread while commit appends to the lists.
        meta.output_token_ids = [list(r.output_token_ids) for r in sampled]
        meta.output_placeholder_src = [rows[id(r)] if r.num_output_placeholders else -1
                                       for r in sampled]
    return mi
