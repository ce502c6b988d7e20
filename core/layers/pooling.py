"""Pooling on the device: the sums of the final hidden states over spans of a step's token
rows, for embedding requests (cadence/pooling). Only the sums leave the device, never the
rows: a 2048-token chunk of mean pooling sends one vector to the host, not 2048.
"""

from __future__ import annotations

import torch


def pooled_sums(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[len(spans), H] float32: row ``j`` is the sum of ``hidden[a:a + c]`` for
    ``spans[j] == (a, c)``.

    NOTE one reduction per span instead of one ``index_add_`` over all of them: a span's rows
    are contiguous, and ``index_add_`` on CUDA adds with atomics, in an order that changes
    from run to run. A step holds few spans (one per embedding request it computes)."""
    return torch.stack([hidden[a:a + c].float().sum(dim=0) for a, c in spans])


def pooled_to_host(sums: torch.Tensor) -> list[list[float]]:
    """The host form ``SamplerOutput.pooled`` carries."""
    return sums.tolist()
