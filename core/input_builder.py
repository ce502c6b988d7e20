"""Build the host-side ``ModelInput`` of a step from the scheduler's plan. No torch here.

O(tokens scheduled) work, done on the critical path; keep it lean.
"""

from __future__ import annotations

from cadence.backend import ModelInput, SamplingMetadata
from cadence.request import Request


def build_model_input(plan, get_block_table,
                      block_size: int) -> ModelInput:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_idx: list[int] = []
    sampled: list[Request] = []
    request_ids: list[str] = []
    prompt_lp = _PromptLogprobRows()
    pool_rows: list[tuple[int, int]] = []
    pool_spans: list[tuple[int, int, int]] = []
    loras: dict[int, str] = {}
    # Speculative decoding: per sampled row, the drafts computed before it; None while no
    # sequence of the step has drafts.
    drafts_before: list[list[int]] | None = None
    for i, sr in enumerate(plan.scheduled):
        req = sr.request
        if req.lora_request is not None:
            loras[req.lora_request.lora_int_id] = req.lora_request.lora_path
        start = req.num_computed_tokens
        end = start + sr.num_new_tokens
        if req.needs_prompt_logprobs:
            prompt_lp.add(i, req, start, end, len(input_ids))
        if req.pooling is not None and (span := req.pooling.wanted(start, end)) is not None:
            pool_rows.append((len(input_ids) + span[0] - start, span[1]))
            pool_spans.append((i, span[0], span[1]))
        table = get_block_table(req.request_id)
        drafts = sr.spec_token_ids
        if sr.num_new_tokens == 1:
            input_ids.append(req.token_at(start))
            positions.append(start)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(req.token_slice(start, end - len(drafts)))
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size
                                for p in range(start, end))
        query_lens.append(sr.num_new_tokens)
        seq_lens.append(end)
        tables.append(table)
        request_ids.append(req.request_id)
        if drafts:
            # Every row of the chunk is sampled: the sequence is named once per row.
            if drafts_before is None:
                drafts_before = [[] for _ in sample_idx]
            for j in range(len(drafts) + 1):
                sample_idx.append(i)
                sampled.append(req)
                drafts_before.append(drafts[:j])
        elif end == req.num_tokens:
            sample_idx.append(i)
            sampled.append(req)
            if drafts_before is not None:
                drafts_before.append([])
    mi = ModelInput(input_ids, positions, slot_mapping, query_lens, seq_lens, tables,
                    plan.num_decodes, sample_idx,
                    build_sampling_metadata(sampled, drafts_before), request_ids)
    if prompt_lp.spans:
        mi.prompt_logprob_rows, mi.prompt_logprob_targets = prompt_lp.rows, prompt_lp.targets
        mi.num_prompt_logprobs, mi.prompt_logprob_spans = prompt_lp.k, prompt_lp.spans
    if pool_rows:
        mi.pool_rows, mi.pool_spans = pool_rows, pool_spans
    if loras:
        mi.lora_paths = loras
        mi.lora_ids = [0 if sr.request.lora_request is None
                       else sr.request.lora_request.lora_int_id for sr in plan.scheduled]
    return mi


class _PromptLogprobRows:
    """The ModelInput's prompt-logprob fields, gathered over the step's sequences."""

    __slots__ = ("k", "rows", "spans", "targets")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.spans: list[tuple[int, int, int]] = []
        self.k = -1

    def add(self, seq_idx: int, req: Request, start: int, end: int, first_row: int) -> None:
        # Position t predicts prompt token t + 1; the last prompt position predicts the
        # first output token, which is sampled, not a prompt logprob.
        last = min(end, req.num_prompt_tokens - 1)
        if last <= start:
            return
        self.rows.extend(range(first_row, first_row + last - start))
        self.targets.extend(req.prompt_token_ids[start + 1:last + 1])
        self.spans.append((seq_idx, start, last - start))
        self.k = max(self.k, req.sampling_params.prompt_logprobs)


def build_sampling_metadata(reqs: list[Request], drafts_before: list[list[int]] | None = None
                            ) -> SamplingMetadata:
    """One row per entry of ``reqs``. ``drafts_before[i]``: the draft tokens row ``i`` was
    computed after (speculative decoding), which count as its output for the seeded draw,
    penalties and min_tokens; None when no row has any."""
    params = [r.sampling_params for r in reqs]
    ahead = [0] * len(reqs) if drafts_before is None else [len(d) for d in drafts_before]
    meta = SamplingMetadata(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        seeds=[p.seed for p in params],
        # Placeholders count: the seeded draw of step N+1 must not depend on whether step N's
        # token reached the host yet (async scheduling).
        output_lens=[len(r.output_token_ids) + r.num_output_placeholders + a
                     for r, a in zip(reqs, ahead)],
        all_greedy=all(p.is_greedy for p in params),
    )
    if any(p.has_penalties for p in params):
        meta.presence_penalty = [p.presence_penalty for p in params]
        meta.frequency_penalty = [p.frequency_penalty for p in params]
        meta.repetition_penalty = [p.repetition_penalty for p in params]
        meta.prompt_token_ids = [r.prompt_token_ids for r in reqs]
        meta.output_token_ids = [r.output_token_ids for r in reqs] if drafts_before is None \
            else [r.output_token_ids + d for r, d in zip(reqs, drafts_before)]
    if any(p.min_tokens for p in params):
        meta.banned_token_ids = [_banned(r, a) for r, a in zip(reqs, ahead)]
    if any(r.bad_words_ids for r in reqs):
        bans = [_bad_word_bans(r) for r in reqs]
        if not meta.banned_token_ids:
            meta.banned_token_ids = [[] for _ in reqs]
        for row, (now, _) in zip(meta.banned_token_ids, bans):
            row.extend(now)
        if any(later for _, later in bans):
            meta.bad_words_pending = [later for _, later in bans]
    if any(p.logit_bias for p in params):
        meta.logit_bias = [p.logit_bias or {} for p in params]
    if any(p.allowed_token_ids for p in params):
        meta.allowed_token_ids = [p.allowed_token_ids or [] for p in params]
    if any(p.logprobs is not None for p in params):
        meta.num_logprobs = [-1 if p.logprobs is None else p.logprobs for p in params]
        meta.max_num_logprobs = max(meta.num_logprobs)
    return meta


def _banned(req: Request, ahead: int = 0) -> list[int]:
    sp = req.sampling_params
    if len(req.output_token_ids) + req.num_output_placeholders + ahead >= sp.min_tokens:
        return []
    if req.grammar is not None:
        # The grammar decides where a constrained output ends: banning EOS where it is the
        # only token the grammar allows would leave nothing to sample.
        return []
    # EOS too under ignore_eos, as vLLM and transformers ban it: min_tokens promises that
    # many tokens of text, and an EOS sampled under ignore_eos is still an end-of-text token.
    ids = [*sp.stop_token_ids, *req.eos_token_ids]
    if sp.allowed_token_ids and set(sp.allowed_token_ids) <= set(ids):
        return []  # as with a grammar: banning every allowed token leaves nothing to sample
    return ids


def _bad_word_bans(req: Request) -> tuple[list[int], list[tuple[int, int]]]:
    """The tokens ``req`` may not sample next for its bad words: those banned now, and
    (newest token, token) pairs to ban if its newest output token, still on the device
    (async scheduling), turns out to be that one."""
    out = req.output_token_ids
    now: list[int] = []
    later: list[tuple[int, int]] = []
    for seq in req.bad_words_ids:
        head, last = seq[:-1], seq[-1]
        if req.num_output_placeholders == 0:
            if not head or (len(out) >= len(head) and tuple(out[-len(head):]) == head):
                now.append(last)
            continue
        # One token in flight (only the newest step has placeholders): the host knows the
        # output up to the token before it.
        known = head[:-1]
        if not head:
            now.append(last)
        elif not known or (len(out) >= len(known) and tuple(out[-len(known):]) == known):
            later.append((head[-1], last))
    return now, later