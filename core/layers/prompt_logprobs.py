"""Prompt logprobs: the log-probability of each prompt token given the tokens before it,
computed from the hidden states of the prefill that holds them (vLLM's ``prompt_logprobs``).

The hidden states of every prompt token exist only inside the forward that computes them,
so the logits of the wanted rows are taken there, after the model, on the device. They are
the raw model logprobs, as the sampled tokens' logprobs are (core/layers/sampler.py): no
temperature, penalty, bias or grammar, none of which applies to a prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadence.layers.ranks import token_ranks

# Rows of logits per slice: [256, 49152] fp32 is 50 MB, where a whole 2048-token prefill
# chunk would be 400 MB at once.
SLICE_ROWS = 256

PromptLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                            k: int) -> PromptLogprobs:
    """For each token row ``rows[j]`` of ``hidden`` [T, H]: the logprob of ``targets[j]``
    [R], its rank (1 = the most likely; ties share the better rank, as for sampled
    tokens), and the ``k`` most likely ids [R, k] with their logprobs [R, k]."""
    parts: list[PromptLogprobs] = []
    for s in range(0, rows.numel(), SLICE_ROWS):
        target = targets[s:s + SLICE_ROWS].unsqueeze(1)
        logits = compute_logits(hidden.index_select(0, rows[s:s + SLICE_ROWS])).float()
        raw = torch.log_softmax(logits, dim=-1)
        lp = raw.gather(1, target)
        rank = token_ranks(raw, lp)
        if k:
            top_lp, top_ids = raw.topk(k, dim=-1)
        else:
            top_lp = raw[:, :0]
            top_ids = torch.empty(raw.shape[0], 0, dtype=torch.int64, device=raw.device)
        parts.append((lp.squeeze(1), rank, top_ids, top_lp))
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def prompt_logprobs_to_host(lp: PromptLogprobs
                            ) -> list[tuple[float, int, list[int], list[float]]]:
    """The host form ``SamplerOutput.prompt_logprobs`` carries."""
    logprob, rank, top_ids, top_lp = (t.tolist() for t in lp)
    return list(zip(logprob, rank, top_ids, top_lp))
