"""Pinned host staging for the CUDA backend: the step's inputs go in as one packed copy, the
samples come out through a side stream; both sides are double-buffered.

Why pinned: a host-to-device copy from pageable memory makes the host wait for the stream
(CUDA syncs before staging it), which would block the host behind the previous forward and
kill the overlap. A copy from pinned memory with ``non_blocking=True`` is only enqueued.

NOTE (double buffers): a non-blocking copy reads (H2D) or writes (D2H) its pinned buffer
some time after the call returns. Rewriting a pinned buffer that an enqueued copy still uses
corrupts that copy silently (vLLM V1 #24527). So each side keeps two buffers used
alternately, each with an event recorded after its copy; before the host touches a buffer
again it waits on that buffer's event. Today ``execute`` waits for its own samples before
returning, so the wait is normally already satisfied; the events keep the invariant true if
a later scheduler pipelines steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from cadence.backend import SamplerOutput
from cadence.layers import sampler


@dataclass(frozen=True, slots=True)
class StagedViews:
    """Device views of one packed step (int64)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    sample_idx: torch.Tensor  # [S]
    seq_lens: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, W]


@dataclass(frozen=True, slots=True)
class InputLayout:
    """Where each array of a step sits in one flat int64 buffer (capacities, not lengths).

    Segments in order: input_ids, positions, slot_mapping [T each], sample_idx [S],
    seq_lens [N], block_tables [N * W].
    """

    num_tokens: int
    num_samples: int
    num_seqs: int
    width: int

    @property
    def tables_offset(self) -> int:
        return 3 * self.num_tokens + self.num_samples + self.num_seqs

    @property
    def size(self) -> int:
        return self.tables_offset + self.num_seqs * self.width

    def size_for_rows(self, num_rows: int) -> int:
        """Elements up to the end of the first ``num_rows`` block-table rows."""
        return self.tables_offset + num_rows * self.width

    def split(self, flat: torch.Tensor) -> StagedViews:
        t, s, n = self.num_tokens, self.num_samples, self.num_seqs
        o = self.tables_offset
        return StagedViews(flat[:t], flat[t:2 * t], flat[2 * t:3 * t], flat[3 * t:3 * t + s],
                           flat[3 * t + s:o], flat[o:o + n * self.width].view(n, self.width))


def pack_inputs(dst: np.ndarray, layout: InputLayout, input_ids: Sequence[int],
                positions: Sequence[int], slot_mapping: Sequence[int], sample_idx: Sequence[int],
                seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
    """Write one step's host lists into ``dst`` (int64) following ``layout``.

    Block-table entries past a row's length are left as they were: the kernels never read a
    table past ``seq_len``, so clearing them would be wasted host time.
    """
    t, s = layout.num_tokens, layout.num_samples
    nt = len(input_ids)
    dst[:nt] = input_ids
    dst[t:t + nt] = positions
    dst[2 * t:2 * t + nt] = slot_mapping
    dst[3 * t:3 * t + len(sample_idx)] = sample_idx
    base = 3 * t + s
    dst[base:base + len(seq_lens)] = seq_lens
    o, w = layout.tables_offset, layout.width
    for i, row in enumerate(block_tables):
        dst[o + i * w:o + i * w + len(row)] = row


def _new_event(device: torch.device) -> Any:
    return torch.cuda.Event() if device.type == "cuda" else None


def _host_buffer(n: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


class InputStager:
    """Double-buffered pinned host buffers feeding one device buffer (see the NOTE above)."""

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._events = [_new_event(self.device), _new_event(self.device)]
        self._next = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        for ev in self._events:  # never free a buffer an enqueued copy still reads
            if ev is not None:
                ev.synchronize()
        self.capacity = capacity
        self._host = [_host_buffer(capacity, self.device) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def stage(self, num_elems: int, fill: Callable[[np.ndarray], None],
              dst: torch.Tensor | None = None) -> torch.Tensor:
        """Fill a pinned buffer on the host, enqueue its copy to ``dst`` (default: own device
        buffer) and return the first ``num_elems`` device elements."""
        if num_elems > self.capacity or (dst is not None and num_elems > dst.numel()):
            if dst is not None:
                raise ValueError(f"staging {num_elems} elements into a {dst.numel()} buffer")
            self._alloc(max(num_elems, 2 * self.capacity))
        i, self._next = self._next, self._next ^ 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # NOTE: the last copy out of buffer i is done
        fill(self._host_np[i][:num_elems])
        target = (self._dev if dst is None else dst)[:num_elems]
        target.copy_(self._host[i][:num_elems], non_blocking=True)
        if self._events[i] is not None:
            self._events[i].record()
        return target


@dataclass(slots=True)
class CopyHandle:
    """A device-to-host copy of one step's samples, in flight until ``event`` completes."""

    buffer: int
    num_rows: int
    logprobs: tuple[torch.Tensor, ...] | None
    num_logprobs: list[int] | None
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None
    pooled: torch.Tensor | None = None


class OutputCopier:
    """Copies sampled ids (and logprobs) to pinned host memory on a side stream.

    ``start`` enqueues the copies behind the sampling kernels and returns at once; ``finish``
    waits on the copy's event only, never on the whole device.
    """

    def __init__(self, device: torch.device | str, max_rows: int = 256) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._events = [_new_event(self.device), _new_event(self.device)]
        self._ids = [_host_buffer(max_rows, self.device) for _ in range(2)]
        self._next = 0

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        if self.stream is not None and src.is_cuda:
            # src was allocated on the compute stream: keep the allocator from reusing its
            # memory before the side-stream copy has read it.
            src.record_stream(self.stream)

    def start(self, sampled: sampler.DeviceSample) -> CopyHandle:
        i, self._next = self._next, self._next ^ 1
        event = self._events[i]
        if event is not None:
            event.synchronize()  # NOTE: the copy that last wrote buffer i has landed
        n = sampled.token_ids.shape[0]
        if n > self._ids[i].shape[0]:
            self._ids[i] = _host_buffer(max(n, 2 * self._ids[i].shape[0]), self.device)
        ctx = nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            ctx = torch.cuda.stream(self.stream)
        with ctx:
            self._copy(sampled.token_ids, self._ids[i][:n])
            logprobs = self._copy_all(sampled.logprobs)
            prompt_logprobs = self._copy_all(sampled.prompt_logprobs)
            pooled = self._copy_all(None if sampled.pooled is None else (sampled.pooled,))
            if event is not None:
                event.record(self.stream)
        return CopyHandle(i, n, logprobs, sampled.num_logprobs, prompt_logprobs,
                          None if pooled is None else pooled[0])

    def _copy_all(self, tensors: tuple[torch.Tensor, ...] | None
                  ) -> tuple[torch.Tensor, ...] | None:
        if tensors is None:
            return None
        # Rare path: fresh pinned tensors per step (torch's host allocator keeps them alive
        # until their copies finish), so no reuse question arises.
        out = tuple(_host_buffer(t.numel(), self.device, t.dtype).view(t.shape)
                    for t in tensors)
        for src, dst in zip(tensors, out):
            self._copy(src, dst)
        return out

    def finish(self, handle: CopyHandle) -> SamplerOutput:
        event = self._events[handle.buffer]
        if event is not None:
            event.synchronize()
        ids = self._ids[handle.buffer][:handle.num_rows]
        return sampler.to_host(sampler.DeviceSample(ids, handle.logprobs, handle.num_logprobs,
                                                    handle.prompt_logprobs, handle.pooled))
