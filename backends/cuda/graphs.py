"""CUDA graphs for decode: one graph per batch-size bucket, sharing static inputs and one
memory pool.

The bucket and padding rules are pure functions (tested on the CPU). A decode batch of n
sequences runs as the graph of the smallest bucket >= n; rows n..bucket-1 are padding:
slot -1 (the KV write skips it), seq_len 1 and a block table naming a dummy block that the
backend keeps out of the engine's block pool, so the padded rows read real memory that no
request owns. Prefill, mixed batches and batches above the largest bucket run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from cadence.backend import ModelInput
from cadence.backends.cuda.attention import decode_metadata
from cadence.backends.cuda.buffers import InputLayout, pack_inputs
from cadence.forward_context import set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (itself
    included even when it is not a multiple of 8), ascending."""
    if max_batch_size < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_batch_size}")
    sizes = [b for b in (1, 2, 4) if b <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows, or None (run eagerly)."""
    for b in sizes:
        if b >= num_seqs:
            return b
    return None


@dataclass(slots=True)
class PaddedDecode:
    """A decode batch padded to its bucket, as host lists."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


def pad_decode(mi: ModelInput, bucket: int, dummy_block: int) -> PaddedDecode:
    """Pad a decode-only step to ``bucket`` rows (see the module docstring)."""
    if not mi.is_decode_only or mi.num_seqs > bucket:
        raise ValueError(f"cannot pad a step of {mi.num_seqs} seqs "
                         f"({mi.num_decodes} decodes) to bucket {bucket}")
    pad = bucket - mi.num_seqs
    return PaddedDecode(
        list(mi.input_ids) + [0] * pad,
        list(mi.positions) + [0] * pad,
        list(mi.slot_mapping) + [-1] * pad,
        list(mi.seq_lens) + [1] * pad,
        list(mi.block_tables) + [[dummy_block]] * pad,
    )


def graph_layout(max_batch_size: int, width: int) -> InputLayout:
    """The static-buffer layout shared by every graph (capacities of the largest bucket)."""
    return InputLayout(max_batch_size, 0, max_batch_size, width)


def pack_padded(dst: Any, layout: InputLayout, padded: PaddedDecode) -> None:
    pack_inputs(dst, layout, padded.input_ids, padded.positions, padded.slot_mapping, [],
                padded.seq_lens, padded.block_tables)


class CudaGraphRunner:
    """Decode graphs captured over one static input buffer.

    ``static`` holds the packed inputs (``graph_layout``); the backend stages each step's
    padded inputs straight into it, then replays. Outputs (logits [bucket, vocab]) live in the
    shared graph pool and are valid until the next replay.
    """

    def __init__(self, model: Any, attn: Any, sizes: list[int], width: int,
                 dummy_block: int, device: torch.device) -> None:
        self.model = model
        self.attn = attn
        self.sizes = sizes
        self.dummy_block = dummy_block
        self.layout = graph_layout(sizes[-1], width)
        self.static = torch.zeros(self.layout.size, dtype=torch.int64, device=device)
        self.views = self.layout.split(self.static)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Off CUDA (tests) nothing is captured and replay runs the same forward eagerly
        # over the static buffers, so padding and staging are still exercised.
        self.simulated = device.type != "cuda"
        self.logits: dict[int, torch.Tensor] = {}
        # Every row starts as padding, so the warm-up and capture runs write no KV.
        self.views.slot_mapping.fill_(-1)
        self.views.seq_lens.fill_(1)
        self.views.block_tables.fill_(dummy_block)

    @torch.inference_mode()
    def _forward(self, bucket: int) -> torch.Tensor:
        md = decode_metadata(self.views, bucket)
        with set_forward_context(self.attn, md):
            hidden = self.model(self.views.input_ids[:bucket], self.views.positions[:bucket])
        return self.model.compute_logits(hidden)  # every row is sampled in a decode

    def capture(self) -> None:
        """Capture largest first: later, smaller graphs reuse the pool's blocks."""
        if self.simulated:
            return
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bucket in reversed(self.sizes):
            # Warm up off the capture (Triton compiles, cuBLAS picks kernels) on a side
            # stream, as torch recommends before capturing.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs),
                    self.sizes)

    def replay(self, bucket: int) -> torch.Tensor:
        if self.simulated:
            return self._forward(bucket)
        self.graphs[bucket].replay()
        return self.logits[bucket]
