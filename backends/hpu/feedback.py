"""Async scheduling on the HPU: step N's sampled ids feed step N+1's placeholders on the
device, at bucket shapes.

NOTE static shapes: a Gaudi compiles one graph per input shape, so nothing here may take a
shape from the number of placeholders. Every step's samples are kept in one device buffer of
fixed size, the decode graph's rows at offset 0 and the prefill graph's after the largest
padded decode batch; a part's input ids are filled with one ``where`` over the whole padded
batch (mask and source rows of the bucket's token count). The warmup runs both for every
bucket (``HpuBackend.warmup``), so async scheduling compiles nothing while serving.

NOTE order: step N+1 reads the buffer in its fill and, for penalties, in its sampling; its
own samples are written only after every part of it is sampled. Lazy mode keeps in-place
ops in program order, and the device runs steps in submission order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from cadence.backend import ModelInput, SamplingMetadata
from cadence.backends.hpu.buckets import padded_rows

if TYPE_CHECKING:
    from cadence.backends.hpu.buckets import BucketConfig, PaddedBatch

_STALE = ("a step planned on the previous step's samples runs after a step that produced "
          "none (it failed): refusing stale token ids")


@dataclass(slots=True)
class Fill:
    """Host data of one part's placeholder fill, over its padded tokens."""

    src: list[int]  # buffer row per padded token (0 where ``mask`` is False)
    mask: list[bool]

    @classmethod
    def nothing(cls, num_tokens: int) -> Fill:
        return cls([0] * num_tokens, [False] * num_tokens)


class SampledIds:
    """The device buffer of the last step's sampled ids, and where each sampled row sits."""

    def __init__(self, buckets: BucketConfig, device: Any, max_num_seqs: int) -> None:
        from cadence.backends.hpu.buckets import find_bucket

        self.device = device
        # A batch past the largest bucket pads to a multiple of it (bucket ranges narrower
        # than the scheduler's limits): size the regions for the largest padded batch.
        num_decode = find_bucket(list(buckets.decode_bs), max_num_seqs)
        self.offsets = {"decode": 0, "prefill": num_decode}
        size = num_decode + find_bucket(list(buckets.prompt_bs), max_num_seqs)
        self.buf = torch.zeros(size, dtype=torch.int64, device=device.torch_device)
        # Host: buffer row of each sampled row of the last step that completed; None while
        # a step runs and after one failed, so that nothing is ever filled from stale ids.
        # ``reading`` is what the step now running reads (ModelRunner keeps the same pair).
        self.rows: list[int] | None = None
        self.reading: list[int] | None = None

    def begin(self) -> None:
        """A step starts: it reads the last step's samples; none are valid until it ends."""
        self.reading, self.rows = self.rows, None

    def fill_for(self, mi: ModelInput, seqs: range, batch: PaddedBatch) -> Fill:
        """Where ``mi``'s placeholders among ``seqs`` land in ``batch``, and their rows."""
        fill = Fill.nothing(batch.shape.num_tokens)
        if not mi.placeholder_idx:
            return fill
        if self.reading is None:
            raise RuntimeError(_STALE)
        at = padded_rows(mi, seqs, batch.shape.query_len, mi.placeholder_idx)
        for k, src in zip(at, mi.placeholder_src):
            if k is not None:
                fill.src[k], fill.mask[k] = self.reading[src], True
        return fill

    def apply(self, input_ids: torch.Tensor, fill: Fill) -> torch.Tensor:
        """``input_ids`` with the placeholders replaced from the buffer, on the device."""
        dev = input_ids.device
        src = torch.tensor(fill.src, dtype=torch.int64).to(dev, non_blocking=True)
        mask = torch.tensor(fill.mask, dtype=torch.bool).to(dev, non_blocking=True)
        self.device.note_graph("fill", input_ids, src, mask, self.buf)
        return torch.where(mask, self.buf.index_select(0, src), input_ids)

    def sampling_rows(self, meta: SamplingMetadata) -> SamplingMetadata:
        """``meta`` with ``output_placeholder_src`` naming buffer rows instead of the last
        step's sampled rows (penalties count those tokens from the buffer)."""
        if not any(s >= 0 for s in meta.output_placeholder_src):
            return meta
        if self.reading is None:
            raise RuntimeError(_STALE)
        rows = self.reading
        return replace(meta, output_placeholder_src=[rows[s] if s >= 0 else -1
                                                     for s in meta.output_placeholder_src])

    def keep(self, parts: list[Any]) -> None:
        """Write a step's samples into the buffer (after the whole step is sampled)."""
        num_sampled = sum(j is not None for p in parts for j in p.rows)
        rows = [0] * num_sampled
        for p in parts:
            off = self.offsets[p.batch.shape.kind]
            ids = p.result.token_ids
            self.device.note_graph("keep", ids)
            self.buf[off:off + ids.shape[0]].copy_(ids)
            for r, j in enumerate(p.rows):
                if j is not None:
                    rows[j] = off + r
        self.rows = rows
