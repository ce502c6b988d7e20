"""The rank of a token in its row of logprobs: 1 + how many tokens are strictly more likely
(ties share the better rank), for sampled tokens' logprobs and prompt logprobs alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Entries counted in uint8 before the sum over the row: at most 128 a chunk, so no overflow.
_CHUNK = 128


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """logprobs [B, V], chosen [B, 1] (a logprob of each row) -> ranks [B] int64.

    NOTE the count runs in uint8 over 128-entry chunks, then in int64 over the chunks:
    torch's sum of a bool tensor into int64 widens every element first, and measured on
    [256, 49152] on 2 CPU cores it took 39 ms against 6.4 ms this way (the comparison itself
    ~8 ms). Integer sums are exact either way.
    """
    above = (logprobs > chosen).view(torch.uint8)
    b, v = above.shape
    pad = -v % _CHUNK
    if pad:
        above = F.pad(above, (0, pad))  # padding counts nothing
    per_chunk = above.view(b, -1, _CHUNK).sum(dim=-1, dtype=torch.uint8)
    return per_chunk.sum(dim=-1, dtype=torch.int64) + 1
