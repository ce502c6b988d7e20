"""Fresh prompts of one step in one attention call per layer (device backends).

``run_prefills`` runs a step's prefill chunks one sequence at a time: one SDPA call (plus
slicing) per prompt per layer. On a GPU that is host time, not device time: a profile of
512 prompts of 128 tokens on an H200 counted 11,352 SDPA calls, ~8 % of the run's host time
(docs/backends/cuda.md). Prompts with no cached context need no gather and no explicit mask,
so they can share one call: each is padded at its end to the group's longest and the batch
runs causally. A real row at position i only sees keys 0..i of its own prompt, all real,
so padding changes nothing it computes; the padded rows' outputs are dropped.

NOTE kept out of the CPU backend's torch path: the CPU flash kernel's block sizes depend on
the sequence length, so a padded prompt's rows could differ in the last bits from its own
call, and the CPU engine keeps async == sync bit-exact across preemptions. The GPU kernels
(flash and memory-efficient) iterate keys in fixed blocks up to the diagonal; a block past
a row's diagonal is fully masked and adds exactly nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A group grows while its padded size stays within this factor of its real tokens.
PAD_SLACK = 1.25


@dataclass(slots=True)
class FreshPrefillBatch:
    """Fresh prompts of one step padded to one length, run in one call per layer."""

    members: frozenset[int]  # their indices in the step's prefill list
    count: int
    length: int  # the longest member's; the others are padded at their end
    gather: torch.Tensor  # [count * length] the token row of each padded position
    keep: torch.Tensor  # [real tokens] padded positions holding real tokens
    rows: torch.Tensor  # [real tokens] their token rows in the step

    def usable(self, sliding_window: int | None, soft_cap: float | None) -> bool:
        """Whether a layer can run the batch: no soft cap (its own masked kernel), and no
        window any member reaches (a row under the window needs an explicit mask)."""
        return soft_cap is None and (sliding_window is None or self.length <= sliding_window)


def plan_fresh_batches(prefills: Sequence, device: torch.device | str
                       ) -> list[FreshPrefillBatch]:
    """Group a step's fresh prompts (``gather_slots is None``) by length, longest first,
    each group padded by at most ``PAD_SLACK``; groups of one stay on the per-prompt path.

    The index tensors are made on the device with ``arange`` (no host copy, which from
    pageable memory would wait for the forward in flight), once per step for every layer.
    """
    fresh = sorted((i for i, p in enumerate(prefills) if p.gather_slots is None),
                   key=lambda i: -prefills[i].query_len)
    groups: list[list[int]] = []
    for i in fresh:
        if groups:
            g = groups[-1]
            real = sum(prefills[j].query_len for j in g) + prefills[i].query_len
            if (len(g) + 1) * prefills[g[0]].query_len <= PAD_SLACK * real:
                g.append(i)
                continue
        groups.append([i])
    batches = []
    for g in groups:
        if len(g) < 2:
            continue
        length = prefills[g[0]].query_len
        steps = torch.arange(length, device=device)
        gather, keep, rows = [], [], []
        for b, i in enumerate(g):
            p = prefills[i]
            gather.append(steps.clamp(max=p.query_len - 1) + p.query_start)
            keep.append(steps[:p.query_len] + b * length)
            rows.append(steps[:p.query_len] + p.query_start)
        batches.append(FreshPrefillBatch(frozenset(g), len(g), length, torch.cat(gather),
                                         torch.cat(keep), torch.cat(rows)))
    return batches


def run_fresh_batch(batch: FreshPrefillBatch, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """One causal SDPA call over the batch's prompts (q [T, H, D], k/v [T, KVH, D]) into
    ``out``'s rows of those prompts."""
    n, length = batch.count, batch.length
    h, d = q.shape[1], q.shape[2]
    kvh = k.shape[1]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [n, heads, L, D], SDPA's 4-D layout
        return x.index_select(0, batch.gather).view(n, length, x.shape[1], d).transpose(1, 2)

    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True,
                                       scale=scale, enable_gqa=kvh != h)
    o = o.transpose(1, 2).reshape(n * length, h, d)
    out.index_copy_(0, batch.rows, o.index_select(0, batch.keep))
