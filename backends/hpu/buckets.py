"""Shape buckets for the HPU backend: pure logic, no torch.

A Gaudi compiles one graph per input shape, so every step is padded up to a bucket and the
warmup compiles every bucket before serving. Three dimensions are bucketed, as in vllm-gaudi:
the batch size, the query length of prefills and the number of KV blocks a sequence reads.

Shapes (``BucketShape``):

- decode ``(batch_size, 1, num_blocks)``: one token per sequence, attention over
  ``num_blocks`` gathered blocks;
- prefill ``(batch_size, query_len, 0)``: chunks with no cached context attend to their own
  keys only;
- prefill ``(batch_size, query_len, num_blocks)``: chunks after a cached context (chunked
  prefill, prefix-cache hits) attend to ``num_blocks`` gathered blocks.

NOTE: padding never changes the outputs. Padded tokens write their K/V to a dummy slot the
scheduler never hands out (the last block of the cache, ``dummy_block``), padded sequences
read only that block, padded query rows are never sampled, and real rows mask padded keys.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING

from cadence.backend import ModelInput

if TYPE_CHECKING:
    from cadence.config import EngineConfig

STRATEGIES = ("exponential", "linear")
RANGE_KEYS = ("prompt_bs", "prompt_seq", "decode_bs", "decode_blocks")


@dataclass(frozen=True, slots=True)
class BucketRange:
    """``min``/``step``/``max`` of one bucketed dimension (all >= 1, min <= max).

    exponential: min, then doubling, then max. linear: doubling from min up to step (a short
    ramp so small values are not padded to ``step``), then every multiple of step, then max.
    """

    min: int
    step: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 1 or self.step < 1 or self.max < self.min:
            raise ValueError(f"bucket range needs 1 <= min <= max and step >= 1, got {self}")

    @classmethod
    def parse(cls, text: str) -> BucketRange:
        """``"min:step:max"`` (the CLI format)."""
        try:
            lo, step, hi = (int(p) for p in text.split(":"))
        except ValueError:
            raise ValueError(f"bucket range must be 'min:step:max' integers, got {text!r}")
        return cls(lo, step, hi)


def generate_buckets(r: BucketRange, strategy: str) -> list[int]:
    """The sorted bucket values of ``r``; every value in [1, r.max] has one at or above it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"bucketing strategy must be one of {STRATEGIES}, got {strategy!r}")
    values = {r.min, r.max}
    v = r.min
    limit = r.max if strategy == "exponential" else min(r.step, r.max)
    while v < limit:
        values.add(v)
        v *= 2
    if strategy == "linear":
        values.update(range(r.step, r.max + 1, r.step))
    return sorted(x for x in values if r.min <= x <= r.max)


def find_bucket(buckets: list[int], value: int) -> int:
    """The smallest bucket >= value; past the largest, the next multiple of the largest (an
    unwarmed shape: the caller warns, and the device compiles a graph at run time)."""
    for b in buckets:
        if b >= value:
            return b
    top = buckets[-1]
    return -(-value // top) * top


@dataclass(frozen=True, slots=True, order=True)
class BucketShape:
    """One compiled graph shape (see the module docstring)."""

    kind: str  # "decode" | "prefill"
    batch_size: int
    query_len: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len

    @property
    def size(self) -> tuple[int, int]:
        """What "largest" means for the warmup order: tokens, then attended keys."""
        return self.num_tokens, self.batch_size * self.query_len * max(self.num_blocks, 1)


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """The bucket values of each dimension, already generated from ranges."""

    prompt_bs: tuple[int, ...]
    prompt_seq: tuple[int, ...]
    decode_bs: tuple[int, ...]
    decode_blocks: tuple[int, ...]
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    with_context: bool = True  # prefix caching or chunked prefill can give cached context

    @classmethod
    def from_ranges(cls, strategy: str, ranges: dict[str, BucketRange], block_size: int,
                    max_num_batched_tokens: int, max_model_len: int, with_context: bool = True
                    ) -> BucketConfig:
        gen = {k: tuple(generate_buckets(r, strategy)) for k, r in ranges.items()}
        return cls(gen["prompt_bs"], gen["prompt_seq"], gen["decode_bs"], gen["decode_blocks"],
                   block_size, max_num_batched_tokens, max_model_len, with_context)


def default_ranges(config: EngineConfig) -> dict[str, BucketRange]:
    """Ranges that cover every step the scheduler can produce under ``config``."""
    sc, bs = config.scheduler_config, config.cache_config.block_size
    max_len = config.model_config.max_model_len
    max_q = min(sc.max_num_batched_tokens, max_len)
    max_blocks = -(-max_len // bs)
    return {
        "prompt_bs": BucketRange(1, 32, max(1, min(sc.max_num_seqs, max_q))),
        "prompt_seq": BucketRange(min(bs, max_q), bs, max_q),
        "decode_bs": BucketRange(1, 32, sc.max_num_seqs),
        "decode_blocks": BucketRange(1, 32, max_blocks),
    }


def bucket_config(config: EngineConfig) -> BucketConfig:
    ranges = default_ranges(config)
    for key in RANGE_KEYS:
        value = config.backend_option(key)
        if isinstance(value, str):
            ranges[key] = BucketRange.parse(value)
        elif value is not None:
            ranges[key] = BucketRange(*value)
    strategy = str(config.backend_option("bucketing", "exponential"))
    sc, cc = config.scheduler_config, config.cache_config
    with_ctx = cc.enable_prefix_caching or sc.enable_chunked_prefill
    return BucketConfig.from_ranges(strategy, ranges, cc.block_size, sc.max_num_batched_tokens,
                                       config.model_config.max_model_len, with_ctx)


def _prev(buckets: tuple[int, ...], b: int) -> int:
    i = buckets.index(b)
    return buckets[i - 1] if i else 0


def warmup_plan(cfg: BucketConfig) -> list[BucketShape]:
    """Every reachable bucket shape, largest first (the memory peak is hit first, so an
    out-of-memory shows at start-up, not under load).

    A shape is reachable when the smallest step that pads to it fits the limits: a prefill
    bucket (B, Q) needs at least prev(B) + 1 sequences, one of them longer than prev(Q), so
    prev(B) + prev(Q) + 1 tokens.
    """
    shapes = [BucketShape("decode", b, 1, n) for b, n in product(cfg.decode_bs, cfg.decode_blocks)
              if (_prev(cfg.decode_blocks, n)) * cfg.block_size < cfg.max_model_len]
    ctx_blocks = (0,) + (cfg.decode_blocks if cfg.with_context else ())
    for b, q, n in product(cfg.prompt_bs, cfg.prompt_seq, ctx_blocks):
        pb, pq = _prev(cfg.prompt_bs, b), _prev(cfg.prompt_seq, q)
        if pb + pq + 1 > cfg.max_num_batched_tokens or pq + 1 > cfg.max_model_len:
            continue
        if n:
            # Context means seq_len > query_len: it must fit n blocks and max_model_len.
            pn = _prev(cfg.decode_blocks, n)
            if n * cfg.block_size < pq + 2 or pn * cfg.block_size + 1 > cfg.max_model_len:
                continue
        shapes.append(BucketShape("prefill", b, q, n))
    return sorted(shapes, key=lambda s: (s.size, s.kind, s.batch_size), reverse=True)


@dataclass(slots=True)
class PaddedBatch:
    """Host data of one bucket-shaped forward: ``batch_size`` rows of ``query_len`` tokens.

    Rows ``num_real`` and above are padding. ``logits_indices[i]`` is the flat index of row
    i's last real token (padding rows: their first token) so logits are [batch_size, vocab].
    """

    shape: BucketShape
    num_real: int
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # [batch_size][num_blocks]
    seq_lens: list[int]
    logits_indices: list[int]


def bucket_for(cfg: BucketConfig, mi: ModelInput, seqs: range, kind: str) -> BucketShape:
    """The shape the sequences ``seqs`` of ``mi`` pad to."""
    b = find_bucket(list(cfg.prompt_bs if kind == "prefill" else cfg.decode_bs), len(seqs))
    if kind == "decode":
        blocks = max(-(-mi.seq_lens[i] // cfg.block_size) for i in seqs)
        return BucketShape("decode", b, 1, find_bucket(list(cfg.decode_blocks), blocks))
    q = find_bucket(list(cfg.prompt_seq), max(mi.query_lens[i] for i in seqs))
    has_ctx = any(mi.seq_lens[i] > mi.query_lens[i] for i in seqs)
    blocks = max(-(-mi.seq_lens[i] // cfg.block_size) for i in seqs)
    n = find_bucket(list(cfg.decode_blocks), blocks) if has_ctx else 0
    return BucketShape("prefill", b, q, n)


def token_starts(mi: ModelInput) -> list[int]:
    """Where each sequence's tokens begin in ``mi``'s flattened token lists."""
    starts, t = [], 0
    for q in mi.query_lens:
        starts.append(t)
        t += q
    return starts


def padded_rows(mi: ModelInput, seqs: range, query_len: int, tokens: list[int]
                ) -> list[int | None]:
    """Where ``tokens`` (indices into ``mi``'s flattened token lists) sit in the padded
    batch of ``seqs`` (``pad_batch``: sequence ``seqs[r]`` from row ``r * query_len``); None
    for a token of a sequence outside ``seqs``."""
    starts = token_starts(mi)
    rows: list[int | None] = []
    for idx in tokens:
        i = bisect.bisect_right(starts, idx) - 1
        rows.append((i - seqs.start) * query_len + idx - starts[i] if i in seqs else None)
    return rows


def pad_batch(mi: ModelInput, seqs: range, shape: BucketShape, dummy_block: int,
              block_size: int) -> PaddedBatch:
    """Pad sequences ``seqs`` of ``mi`` (all decodes or all prefills) to ``shape``."""
    q, nb = shape.query_len, shape.num_blocks
    dummy_slot = dummy_block * block_size
    starts = token_starts(mi)
    ids, pos, slots, tables, lens, logit_idx = [], [], [], [], [], []
    for row in range(shape.batch_size):
        if row < len(seqs):
            i = seqs[row]
            s, ql = starts[i], mi.query_lens[i]
            pad = q - ql
            ids += mi.input_ids[s:s + ql] + [0] * pad
            # Padded tokens sit at position 0 (a valid rotary index) and write to the dummy
            # slot, so the real cache is untouched.
            pos += mi.positions[s:s + ql] + [0] * pad
            slots += mi.slot_mapping[s:s + ql] + [dummy_slot] * pad
            bt = mi.block_tables[i][:nb]
            tables.append(bt + [dummy_block] * (nb - len(bt)))
            lens.append(mi.seq_lens[i])
            logit_idx.append(row * q + ql - 1)
        else:
            # A padded sequence: one "token" in the dummy block, so its softmax stays finite.
            ids += [0] * q
            pos += [0] * q
            slots += [dummy_slot] * q
            tables.append([dummy_block] * nb)
            lens.append(1)
            logit_idx.append(row * q)
    return PaddedBatch(shape, len(seqs), ids, pos, slots, tables, lens, logit_idx)


def dummy_batch(shape: BucketShape, dummy_block: int, block_size: int) -> PaddedBatch:
    """An all-padding batch of ``shape`` (what the warmup runs)."""
    empty = ModelInput([], [], [], [], [], [], 0, [], None)  # type: ignore[arg-type]
    return pad_batch(empty, range(0), shape, dummy_block, block_size)
