"""Applying a step's grammar bitmask to its logits, with torch ops that run on any device
(CPU, CUDA, HPU): masked tokens get -inf before anything else in the sampler."""

from __future__ import annotations

from typing import Any

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] (bit t % 32 of word t // 32 = token t allowed) -> bool [R, vocab_size];
    tokens beyond the bitmask's 32 * W are not allowed."""
    dev = words.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1).bool()
    width = bits.shape[1]
    if width >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - width), value=False)


def apply_grammar_bitmask(logits: torch.Tensor, grammar: Any) -> torch.Tensor:
    """``logits`` [B, V] with the disallowed tokens of ``grammar.rows`` set to -inf.

    The bitmask is host memory (numpy); on CUDA it goes through pinned memory, so the copy
    does not wait for the forward queued before it.
    """
    words = torch.from_numpy(grammar.get())
    dev = logits.device
    if dev.type == "cuda":
        words = words.pin_memory().to(dev, non_blocking=True)
    elif dev.type != "cpu":
        words = words.to(dev)
    b, v = logits.shape
    allowed = unpack_bitmask(words, v)
    rows = grammar.rows
    if len(rows) == b and rows == list(range(b)):
        return logits.masked_fill(~allowed, float("-inf"))
    idx = torch.tensor(rows, dtype=torch.int64)
    if dev.type == "cuda":
        idx = idx.pin_memory().to(dev, non_blocking=True)
    elif dev.type != "cpu":
        idx = idx.to(dev)
    masked = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, idx, masked)
