"""Per-request output bookkeeping: one ``ParentRequest`` per user request, fanning out to
``n`` engine ``Request``s. No torch here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cadence.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from cadence.request import Request
from cadence.sampling_params import OutputKind


@dataclass(slots=True)
class SeqOutputState:
    """Finalize-side state of one sequence."""

    detokenizer: object = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    is_final: bool = False
    # Streaming progress: how much text/tokens the previous outputs already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_sent: bool = False


@dataclass(slots=True)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    output_kind: OutputKind
    arrival_time: float = field(default_factory=time.monotonic)
    final_emitted: bool = False
    error: str | None = None
    # vLLM's RequestOutput.prompt_logprobs, once every one is computed (first entry None);
    # a DELTA stream carries them once, in the first output after that.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False

    def make_output(self, finished: bool) -> RequestOutput | None:
        """The request's output now; None when a DELTA output would carry nothing new.

        A DELTA output lists only the samples with new tokens or text, or a finish not
        reported before (vLLM's n > 1 streams do the same): a finished sample is reported
        finished once, and a client never sees the same finish twice.
        """
        if self.children[0].pooling is not None:
            return self._embedding() if finished else None
        outs = [self._completion(c) for c in self.children]
        prompt_lp = self.prompt_logprobs
        if self.output_kind is OutputKind.DELTA:
            outs = [o for o, c in zip(outs, self.children) if self._is_news(o, c)]
            if self.prompt_logprobs_sent:
                prompt_lp = None
            if not outs and not finished and prompt_lp is None:
                return None
            if prompt_lp is not None:
                self.prompt_logprobs_sent = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             finished, self._metrics(finished),
                             self.children[0].num_cached_tokens, prompt_logprobs=prompt_lp,
                             error=self.error)

    def _metrics(self, finished: bool) -> RequestMetrics:
        first = [c.first_token_time for c in self.children if c.first_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=min(first) if first else None,
            finished_time=time.monotonic() if finished else None,
            num_preemptions=sum(c.num_preemptions for c in self.children),
            num_cached_tokens=self.children[0].num_cached_tokens,
        )

    def _embedding(self) -> EmbeddingRequestOutput:
        """The final output of an embedding request: its vector, unless it was aborted or
        failed before its prompt was computed (its one sampled token is never shown)."""
        c = self.children[0]
        state = c.pooling
        vec = None if self.error is not None or not state.is_complete else state.embedding()
        metrics = self._metrics(True)
        metrics.first_token_time = None  # its one token is dropped: no first token
        return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                      None if vec is None else EmbeddingOutput(vec), True,
                                      metrics, c.num_cached_tokens, self.error)

    @staticmethod
    def _is_news(o: CompletionOutput, c: Request) -> bool:
        st: SeqOutputState = c.detok_state
        if o.finish_reason is not None and not st.finish_sent:
            st.finish_sent = True
            return True
        return bool(o.token_ids or o.text)

    def _completion(self, c: Request) -> CompletionOutput:
        st: SeqOutputState = c.detok_state
        done = st.is_final
        text = c.output_text
        # A stop string may still be forming at the end of the text: hold those characters
        # back until the request finishes, so no streamed delta ever has to be taken back.
        visible = len(text) if done else max(len(text) - c.sampling_params.output_text_buffer_length,
                                             st.num_sent_chars)
        n_tok = c.num_finalized_tokens
        has_lp = c.sampling_params.logprobs is not None
        # A sibling's transition (a preemption's settle) can emit this output between the
        # commit that finished this sample and its finalize: its status says finished, but
        # its last tokens are not out yet. It is finished once they are.
        reason, stop = (c.status.finish_reason, c.stop_reason) if done else (None, None)
        if self.output_kind is OutputKind.DELTA:
            t0, k0 = st.num_sent_chars, st.num_sent_tokens
            st.num_sent_chars, st.num_sent_tokens = visible, n_tok
            return CompletionOutput(
                c.index, text[t0:visible], c.output_token_ids[k0:n_tok],
                st.cumulative_logprob if has_lp else None,
                st.logprobs[k0:n_tok] if has_lp else None,
                reason, stop)
        return CompletionOutput(
            c.index, text[:visible], c.output_token_ids[:n_tok],
            st.cumulative_logprob if has_lp else None,
            list(st.logprobs) if has_lp else None,
            reason, stop)
