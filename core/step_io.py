"""What one step carries across the Backend boundary: the ``ModelInput`` the engine builds
with its ``SamplingMetadata``, and the ``SamplerOutput`` that comes back. No torch here.

Plain host data (lists of ints and floats), so a ``ModelInput`` can be pickled to a worker
process and holds no closure (vLLM #9931). ``cadence.backend`` re-exports all three: they
are part of the contract a plugin implements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplingMetadata:
    """Per sampled row (one per entry of ``ModelInput.sample_seq_indices``), host data.

    Seeded rows are reproducible without generator state: the sampler seeds the row's
    generator from ``(seeds[i], output_lens[i])``, i.e. from the request's seed and how many
    tokens it has generated, so the draw is the same whatever the batch, after a preemption,
    and with async output processing on or off.
    """

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int | None]
    output_lens: list[int]
    all_greedy: bool
    # Penalties: filled only when some row uses one (otherwise empty lists).
    presence_penalty: list[float] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    repetition_penalty: list[float] = field(default_factory=list)
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Token ids each row may not sample now: EOS and stop ids while below min_tokens, and
    # the tokens that would complete a bad word.
    banned_token_ids: list[list[int]] = field(default_factory=list)
    # Async scheduling, bad words whose second-to-last token is the row's newest output
    # token, not on the host yet: per row, (that token, the token to ban if it is) pairs;
    # the backend checks them against its device-side copy (``output_placeholder_src``).
    # Empty when no row has any.
    bad_words_pending: list[list[tuple[int, int]]] = field(default_factory=list)
    # Per row, token id -> bias added to its logit ({} for none); empty when no row has one.
    logit_bias: list[dict[int, float]] = field(default_factory=list)
    # Per row, the only token ids it may sample ([] for no restriction); empty when no row
    # has one.
    allowed_token_ids: list[list[int]] = field(default_factory=list)
    # Top-k logprobs wanted per row (-1: none); max_num_logprobs < 0 when no row wants any.
    num_logprobs: list[int] = field(default_factory=list)
    max_num_logprobs: int = -1
    # Async scheduling, filled only when some row uses penalties and has a placeholder: per
    # row, -1 or the row of the previous step's sampled ids that holds this row's newest
    # output token, which ``output_token_ids`` lacks (it is not on the host yet). The
    # backend counts it from its device-side copy (docs/async_scheduling.md).
    output_placeholder_src: list[int] = field(default_factory=list)
    # Structured output: a ``GrammarBitmask`` (core/structured_output/bitmask.py) for the
    # rows that follow a grammar, or None. Its bitmask is computed by the engine inside
    # ``post_sample`` (while the device runs the forward), or by ``get()`` at sampling time
    # if that comes first. Backends apply it before sampling, through the shared sampler.
    grammar: Any = None

    @property
    def has_penalties(self) -> bool:
        return bool(self.repetition_penalty)


@dataclass(slots=True)
class ModelInput:
    """One forward pass, described with host data.

    Sequences are ordered decodes first (``num_decodes`` of them, one query token each),
    then prefill chunks. Token-level lists are flattened over sequences in that order.
    ``slot_mapping[t]`` is where token ``t``'s K/V goes in the paged cache
    (``block * block_size + offset``).
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_seq_indices: list[int]
    sampling: SamplingMetadata
    request_ids: list[str] = field(default_factory=list)
    # Async scheduling: ``input_ids[placeholder_idx[i]]`` is PLACEHOLDER_TOKEN_ID and must
    # become ``sampled_token_ids[placeholder_src[i]]`` of the step submitted just before this
    # one, on the device, before the forward. Empty otherwise.
    placeholder_idx: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)
    # Prompt logprobs: the token rows (indices into ``input_ids``) whose next prompt token's
    # logprob is wanted, that token (``prompt_logprob_targets``), and how many of the most
    # likely tokens to return for every such row (the most any request asks for). Empty and
    # -1 when no request asks. ``prompt_logprob_spans`` is the engine's own bookkeeping, not
    # the backend's: (sequence index, first prompt position, count) per run of those rows.
    prompt_logprob_rows: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = -1
    prompt_logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Embeddings (cadence/pooling): per span of token rows to pool, (first row, row count);
    # the backend returns each span's sum of final hidden states (core/layers/pooling.py) in
    # ``SamplerOutput.pooled``. ``pool_spans`` is the engine's bookkeeping: (sequence index,
    # first prompt position, count) per span. Empty when no embedding request computes.
    pool_rows: list[tuple[int, int]] = field(default_factory=list)
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # LoRA adapters (cadence/lora): per sequence, the adapter id its rows run with (0: the
    # base model), and each id's adapter folder. Both empty when no sequence of the step
    # has an adapter; the backend's runner applies them (``ModelRunner.prepare``).
    lora_ids: list[int] = field(default_factory=list)
    lora_paths: dict[int, str] = field(default_factory=dict)
    def sampled_rows(self) -> list[int]:
        """The token row (index into ``input_ids``) of every sampled row, in
        ``sample_seq_indices`` order. A sequence named ``g`` times in a row samples its last
        ``g`` rows: its own token's and its drafts' (speculative decoding, cadence/spec_decode);
        named once, its last row."""
        ends, total = [], 0
        for q in self.query_lens:
            total += q
            ends.append(total - 1)
        seqs = self.sample_seq_indices
        rows = [0] * len(seqs)
        for k in range(len(seqs) - 1, -1, -1):
            s = seqs[k]
            rows[k] = rows[k + 1] - 1 if k + 1 < len(seqs) and seqs[k + 1] == s else ends[s]
        return rows

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)


@dataclass(slots=True)
class SamplerOutput:
    """Host copy of one step's samples, one entry per sampled row.

    ``logprobs[i]`` is ``None`` or ``(sampled_logprob, sampled_rank, top_ids, top_logprobs)``.
    ``prompt_logprobs[j]`` is the same for ``ModelInput.prompt_logprob_rows[j]``'s target,
    with ``num_prompt_logprobs`` top entries; None when the step asked for none.
    """

    sampled_token_ids: list[int]
    logprobs: list[tuple[float, int, list[int], list[float]] | None] | None = None
    prompt_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    #: Per ``ModelInput.pool_rows`` span, the float32 sum of its rows' final hidden states;
    #: None when the step asked for none.
    pooled: list[list[float]] | None = None
    #: Seconds the device spent on this step's forward + sampling, when the backend measures
    #: it where the host cannot (a worker process); 0.0 otherwise. For the bench breakdown.
    device_seconds: float = 0.0
    #: ``time.monotonic()`` when this step's results were ready on the host side of the
    #: device (a worker process's clock is the same system-wide monotonic clock); 0.0 when
    #: the backend does not know. With ``PostSample``'s own timestamps it tells how much of
    #: post_sample ran while the device was still busy. For the bench breakdown.
    device_done_at: float = 0.0
