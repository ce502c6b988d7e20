"""Commit and finalize: the two halves of a step's output work. No torch here.

- ``commit`` runs on the critical path right after sampling: it appends the sampled token
  ids (and raw logprobs) and runs the O(1) stop checks (EOS, stop token ids, max_tokens,
  max_model_len). A request stopped here is never scheduled again, so EOS costs no step.
- ``finalize`` is deferred into the next step's post-sample callback, while the device
  computes: incremental detokenization, stop strings, logprob formatting, RequestOutput
  creation, freeing KV blocks of finished requests, stats and the post-sample hook.

NOTE the lag: stop strings are found one step late. The request was already scheduled once
more; ``catch_up`` truncates its tokens back to the stop token and marks it finished, and
``commit`` of that extra step sees a finished request and drops its token. Every transition
(finish, abort, preempt) goes through ``settle``, which first catches the request up, so no
pending token is applied to a reset request and nothing is freed or emitted twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cadence.backend import ModelInput, SamplerOutput
from cadence.detokenizer import IncrementalDetokenizer, find_stop_string
from cadence.logprob_text import LogprobFormatter
from cadence.metrics import EngineStats
from cadence.output_state import OutputKind, ParentRequest, SeqOutputState
from cadence.outputs import RequestOutput
from cadence.request import Request, RequestStatus
from cadence.spec_decode.acceptance import accept_drafts
from cadence.structured_output.manager import advance as advance_grammar

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Owns the host-side state of every live request's output."""

    def __init__(self, tokenizer: Any, free_request: Callable[[Request], None],
                 stats: EngineStats, post_sample_hook: Callable[[list], None] | None,
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.free_request = free_request
        self.stats = stats
        self.post_sample_hook = post_sample_hook
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentRequest] = {}
        self.ready: list[RequestOutput] = []
        self.logprobs = LogprobFormatter(tokenizer)

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            child.detok_state = SeqOutputState()

    def holds_sample(self, request_id: str) -> bool:
        """Whether ``request_id`` names a sample of a live request with n > 1 (its
        ``<index>_<parent>`` id): taken until the parent's last output, even once that
        sample finished and left the scheduler."""
        _, _, parent_id = request_id.partition("_")
        p = self.parents.get(parent_id)
        return p is not None and len(p.children) > 1 and \
            any(c.request_id == request_id for c in p.children)

    # ---- commit (critical path) -------------------------------------------------------
    def commit(self, scheduled: list, sample_seq_indices: list[int], out: SamplerOutput,
               mi: ModelInput | None = None) -> list[Request]:
        """Append sampled tokens and run O(1) stop checks; return the requests touched.
        ``mi``: the step's input, whose spans say whose prompt logprobs and pooled sums
        ``out`` carries."""
        if mi is not None:
            _file_prompt_outputs(scheduled, out, mi)
        touched = []
        refused: list[Request] = []
        logprobs = out.logprobs
        k, num_rows = 0, len(sample_seq_indices)
        while k < num_rows:
            entry = scheduled[sample_seq_indices[k]]
            req: Request = entry.request
            if entry.spec_token_ids:
                k += self._commit_drafts(entry, out, k, touched)
                continue
            k += 1
            if req.is_finished:
                continue  # finished by a stop string or an abort since it was scheduled
            token = out.sampled_token_ids[k - 1]
            req.output_token_ids.append(token)
            req.output_logprobs.append(logprobs[k - 1] if logprobs is not None else None)
            touched.append(req)
            if req.grammar is not None and self._advance_grammar(req, token, refused):
                continue
            if req.pooling is not None:  # its prompt is computed: that is all it asked
                req.status = RequestStatus.FINISHED_STOPPED
                continue
            self._check_stop(req, token)
        for req in refused:
            self.fail(req.parent_id, f"structured output: the grammar refused token "
                      f"{req.output_token_ids[-1]} (an engine bug, please report it)")
        return touched

    def _commit_drafts(self, entry: Any, out: SamplerOutput, first: int,
                       touched: list[Request]) -> int:
        """Commit a request's rows with drafts (speculative decoding): its tokens up to the
        first that differs from its draft, each stop-checked; returns the rows it had."""
        drafts = entry.spec_token_ids
        req: Request = entry.request
        sampled = out.sampled_token_ids[first:first + len(drafts) + 1]
        self.stats.num_draft_tokens += len(drafts)
        # vLLM's count: drafts the model agreed with, whether or not a stop came first.
        self.stats.num_accepted_tokens += next(
            (j for j, d in enumerate(drafts) if sampled[j] != d), len(drafts))
        if req.is_finished:
            return len(drafts) + 1
        logprobs = out.logprobs

        def take(j: int, token: int) -> bool:
            req.output_token_ids.append(token)
            req.output_logprobs.append(logprobs[first + j] if logprobs is not None else None)
            self._check_stop(req, token)
            return req.is_finished

        entry.num_accepted = accept_drafts(sampled, drafts, take)
        touched.append(req)
        return len(drafts) + 1

    @staticmethod
    def _advance_grammar(req: Request, token: int, refused: list[Request]) -> bool:
        """Feed ``token`` to the request's grammar; True if that ended the request (the
        grammar terminated: finish reason ``stop``)."""
        if not advance_grammar(req, token):
            refused.append(req)
            return True
        if req.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if token in req.eos_token_ids and not sp.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return
            if token in sp.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return
        if (sp.max_tokens is not None and n_out >= sp.max_tokens) or \
                req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    # ---- finalize (deferred) ----------------------------------------------------------
    def finalize(self, requests: list[Request]) -> None:
        """Catch the host side of ``requests`` up with their committed tokens and emit."""
        parents: dict[str, ParentRequest] = {}
        for req in requests:
            try:
                changed = self.catch_up(req)
            except Exception as e:
                # A detokenizer or stop-string failure belongs to this request alone.
                logger.exception("finalizing request %r failed", req.request_id)
                self.fail(req.parent_id, f"the engine failed on this request: {e!r}")
                continue
            if changed:
                p = self.parents.get(req.parent_id)
                if p is not None:
                    parents[p.request_id] = p
        self._publish([o for p in parents.values() if (o := self._emit(p)) is not None])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Every output leaves through here, so the post-sample hook sees all of them: those
        of finalize, and those a stop found at preemption time or an abort emits."""
        if outputs:
            self.ready.extend(outputs)
            if self.post_sample_hook is not None:
                self.post_sample_hook(outputs)

    def catch_up(self, req: Request) -> bool:
        """Detokenize and stop-check the committed tokens not yet finalized.

        Returns whether anything changed (new tokens, or the request finished).
        Idempotent: a second call with nothing new is a no-op.
        """
        st: SeqOutputState = req.detok_state
        if st is None or st.is_final:
            return False
        start = req.num_finalized_tokens
        end = len(req.output_token_ids)
        for i in range(start, end):
            self._finalize_token(req, st, i)
            if req.stop_reason is not None and isinstance(req.stop_reason, str):
                # Everything after the stop token disappears: tokens, logprobs, stats.
                del req.output_token_ids[i + 1:]
                del req.output_logprobs[i + 1:]
                end = i + 1
                break
        req.num_finalized_tokens = end
        if req.pooling is None:  # an embedding request's one token is never output
            self.stats.num_generation_tokens += end - start
        if not req.is_finished:
            return end > start
        st.is_final = True
        self.free_request(req)
        self.stats.on_request_finished(req)
        return True

    def _finalize_token(self, req: Request, st: SeqOutputState, i: int) -> None:
        sp = req.sampling_params
        token = req.output_token_ids[i]
        lp = req.output_logprobs[i]
        if lp is not None:
            st.cumulative_logprob += lp[0]
            st.logprobs.append(self.logprobs.entry(
                token, lp, sp.detokenize, req.output_token_ids[max(0, i - 4):i]))
        if not sp.detokenize or _is_hidden_stop_token(req, i):
            return
        if st.detokenizer is None:
            st.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                    sp.skip_special_tokens,
                                                    sp.spaces_between_special_tokens)
        new = st.detokenizer.step(token)
        if not new:
            return
        req.output_text += new
        # As vLLM: a stop string ends the output only with a token past min_tokens.
        if sp.stop and i + 1 > sp.min_tokens:
            hit = find_stop_string(req.output_text, len(new), sp.stop)
            if hit is not None:
                stop, at = hit
                keep = at + len(stop) if sp.include_stop_str_in_output else at
                req.output_text = req.output_text[:keep]
                req.stop_reason = stop
                req.status = RequestStatus.FINISHED_STOPPED

    def _emit(self, p: ParentRequest) -> RequestOutput | None:
        finished = all(c.detok_state.is_final for c in p.children)
        if p.output_kind is OutputKind.FINAL_ONLY and not finished:
            return None
        if p.final_emitted:
            return None
        owner = p.children[0]
        if p.prompt_logprobs is None and owner.prompt_logprobs is not None \
                and not owner.needs_prompt_logprobs:
            p.prompt_logprobs = self.logprobs.prompt(
                p.prompt_token_ids, owner.prompt_logprobs,
                owner.sampling_params.prompt_logprobs, owner.sampling_params.detokenize)
        out = p.make_output(finished)
        if finished:
            p.final_emitted = True
            del self.parents[p.request_id]
        return out

    # ---- transitions ------------------------------------------------------------------
    def settle(self, req: Request) -> None:
        """Finalize ``req``'s pending output before any transition touches it."""
        if self.catch_up(req):
            p = self.parents.get(req.parent_id)
            if p is not None and (o := self._emit(p)) is not None:
                self._publish([o])

    def abort(self, parent_id: str, abort_child: Callable[[Request], None]) -> None:
        self._end(parent_id, RequestStatus.FINISHED_ABORTED, abort_child)

    def fail(self, parent_id: str, message: str) -> None:
        """End every sample of a request with finish_reason ``"error"`` and free it; the
        final output carries ``message``."""
        p = self.parents.get(parent_id)
        if p is not None and p.error is None:
            p.error = message
        self._end(parent_id, RequestStatus.FINISHED_ERROR, self.free_request)

    def _end(self, parent_id: str, status: RequestStatus,
             release: Callable[[Request], None]) -> None:
        p = self.parents.get(parent_id)
        if p is None:
            return
        for child in p.children:
            try:
                self.catch_up(child)
            except Exception:  # failing already: the tokens it has are all it gets
                logger.exception("finalizing request %r failed", child.request_id)
            if not child.detok_state.is_final:
                release(child)
                child.status = status
                child.detok_state.is_final = True
                self.free_request(child)
                self.stats.on_request_finished(child)
        if (o := self._emit(p)) is not None:
            self._publish([o])

    def fail_all(self, message: str) -> None:
        """``fail`` every live request (the device state they depended on is gone)."""
        for parent_id in list(self.parents):
            self.fail(parent_id, message)

    def take_ready(self) -> list[RequestOutput]:
        out, self.ready = self.ready, []
        return out


def _is_hidden_stop_token(req: Request, i: int) -> bool:
    """Whether output token ``i`` is the EOS or stop token id that ended ``req`` and its text
    stays out of ``output_text`` (vLLM's rule, so a reply never ends in "</s>" even with
    skip_special_tokens=False; include_stop_str_in_output brings it back). Commit finished
    the request on its last token; a stop string (a str stop_reason) is only found later,
    in finalize, so it never counts here."""
    return (i == len(req.output_token_ids) - 1 and req.status is RequestStatus.FINISHED_STOPPED
            and not isinstance(req.stop_reason, str)
            and not req.sampling_params.include_stop_str_in_output)


def _file_prompt_outputs(scheduled: list, out: SamplerOutput, mi: ModelInput) -> None:
    """File the step's prompt logprobs and pooled sums with their requests, by prompt
    position: a prompt computed again after a preemption overwrites, never adds."""
    if out.prompt_logprobs is not None:
        rows, j = out.prompt_logprobs, 0
        for seq_idx, start, count in mi.prompt_logprob_spans:
            req = scheduled[seq_idx].request
            if req.prompt_logprobs is not None:
                req.prompt_logprobs[start:start + count] = rows[j:j + count]
            j += count
    if out.pooled is not None:
        for (seq_idx, start, count), sums in zip(mi.pool_spans, out.pooled):
            req = scheduled[seq_idx].request
            if req.pooling is not None:
                req.pooling.add(start, count, sums)
