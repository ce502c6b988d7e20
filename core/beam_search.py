"""Beam search over the engine: vLLM's ``LLM.beam_search`` and the server's
``use_beam_search``. No torch here.

The engine itself samples one token per request per step; beam search is a front-end loop on
top of it, as in vLLM. Each round asks, for every live beam of every prompt, one greedy
token with the ``2 * beam_width`` most likely next tokens and their raw log-probabilities
(a request whose prompt is the prompt plus the beam, so prefix caching computes only what
changed), then keeps the best. The choice of beams follows transformers' beam search
(``generate(num_beams=...)``): of every beam's expansions ranked by cumulative
log-probability, an EOS within the first ``beam_width`` ranks ends a hypothesis, and the
best non-EOS expansions, up to ``beam_width``, go on; the search stops once ``beam_width``
hypotheses are finished and the best live beam, scored at its present length, no longer
beats the worst of them. Finished hypotheses are ranked by
``cumulative logprob / generated_length ** length_penalty`` (the length counts an EOS).
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadence.sampling_params import FieldError, SamplingParams

# Most beams one prompt may keep: each is a request per step.
MAX_BEAM_WIDTH = 64


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How to search (vLLM's ``BeamSearchParams``, without its temperature: beams are ranked
    by the model's own log-probabilities, which no temperature changes).

    ``beam_width`` beams are kept and returned; ``max_tokens`` bounds each; ``ignore_eos``
    searches on through EOS; ``length_penalty`` is the exponent of the generated length that
    divides a finished hypothesis' cumulative log-probability (1.0 ranks by mean
    log-probability, 0.0 by the sum). Bad values raise ``FieldError`` naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name, top in (("beam_width", MAX_BEAM_WIDTH), ("max_tokens", None)):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1 or \
                    (top is not None and v > top):
                bound = f" and <= {top}" if top is not None else ""
                raise FieldError(f"{name} must be an integer >= 1{bound}, got {v!r}", name)
        if not isinstance(self.ignore_eos, bool):
            raise FieldError(f"ignore_eos must be true or false, got {self.ignore_eos!r}",
                             "ignore_eos")
        lp = self.length_penalty
        if not isinstance(lp, numbers.Real) or isinstance(lp, bool) or \
                not math.isfinite(lp):
            raise FieldError(f"length_penalty must be a finite number, got {lp!r}",
                             "length_penalty")


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam. ``tokens`` holds the prompt and the generated tokens (vLLM's
    convention); ``output_token_ids`` and ``text`` the generated part alone."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[float]  # per generated token
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Beam:
    tokens: list[int]
    logprobs: list[float]
    cum: float


class BeamSearch:
    """The search state of one prompt. ``requests()`` names the round's requests (one per
    live beam), ``advance(tops)`` takes each one's top next tokens and log-probabilities."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_ids: Sequence[int], max_model_len: int) -> None:
        self.prompt = list(prompt_ids)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_ids)
        room = max_model_len - len(self.prompt)
        if room <= 0:
            raise FieldError(f"prompt has {len(self.prompt)} tokens; it must be shorter than "
                             f"max_model_len={max_model_len} to leave room for output",
                             "prompt")
        if params.max_tokens > room:
            raise FieldError(f"this model's maximum context length is max_model_len="
                             f"{max_model_len} tokens; {len(self.prompt)} in the prompt + "
                             f"max_tokens={params.max_tokens} is "
                             f"{len(self.prompt) + params.max_tokens}; lower max_tokens to "
                             f"{room} or less", "max_tokens")
        self.room = params.max_tokens
        self.live = [_Beam([], [], 0.0)]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.live

    def requests(self) -> list[list[int]]:
        return [self.prompt + b.tokens for b in self.live]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """``tops[i]``: the most likely next tokens of live beam ``i`` -> their logprob."""
        width = self.params.beam_width
        # Best first; ties go to the earlier beam, then the smaller token id.
        ranked = sorted(((b.cum + lp, -i, -t, lp, b) for i, (b, top) in enumerate(
            zip(self.live, tops, strict=True)) for t, lp in top.items()), reverse=True,
            key=lambda c: c[:3])
        live: list[_Beam] = []
        for rank, (cum, _, neg_token, lp, beam) in enumerate(ranked):
            token = -neg_token
            grown = _Beam(beam.tokens + [token], beam.logprobs + [lp], cum)
            if token in self.eos:
                if rank < width:  # transformers' rule: only a top-ranked EOS ends a beam
                    self._finish(grown, "stop")
                continue
            live.append(grown)
            if len(live) == width:
                break
        self.live = []
        for b in live:
            if len(b.tokens) >= self.room:
                self._finish(b, "length")
            else:
                self.live.append(b)
        if self.live and len(self.finished) >= width:
            # transformers' stop (early_stopping=False): the best live beam, scored at its
            # present length, no longer beats the worst of the best finished ones.
            worst = heapq.nlargest(width, (f.score for f in self.finished))[-1]
            best = max(b.cum for b in self.live)
            if best / len(self.live[0].tokens) ** self.params.length_penalty <= worst:
                self.live = []

    def _finish(self, beam: _Beam, reason: str) -> None:
        n = len(beam.tokens)
        score = beam.cum / (n ** self.params.length_penalty)
        self.finished.append(BeamSearchSequence(self.prompt + beam.tokens, len(self.prompt),
                                                beam.logprobs, beam.cum, score, reason))

    def output(self, decode: Callable[[list[int], list[int]], str] | None
               ) -> BeamSearchOutput:
        """The best ``beam_width`` finished hypotheses; ``decode(prompt, tokens)`` gives
        each one's text (``detokenizer``)."""
        best = heapq.nlargest(self.params.beam_width, self.finished,
                              key=lambda s: s.score)
        if decode is not None:
            for s in best:
                # The EOS that ended a beam is not text, as a generation's is not.
                ids = s.output_token_ids
                s.text = decode(self.prompt, ids[:-1] if s.finish_reason == "stop" else ids)
        return BeamSearchOutput(best, self.prompt)


def detokenizer(tokenizer: Any, skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True
                ) -> Callable[[list[int], list[int]], str]:
    """A beam's text as a generation's would read: decoded as a continuation of its prompt
    (a token that completes a character begun in the prompt), through the engine's
    incremental detokenizer."""
    from cadence.detokenizer import IncrementalDetokenizer

    def decode(prompt: list[int], tokens: list[int]) -> str:
        d = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens,
                                   spaces_between_special_tokens)
        return "".join(d.step(t) for t in tokens)

    return decode


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam asks of the engine per round: one greedy token, and the
    ``2 * beam_width`` most likely with their raw log-probabilities (as many as
    transformers looks at, so an EOS among them cannot crowd out the beams)."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                          logprobs=2 * params.beam_width)


def top_logprobs(output: Any) -> dict[int, float]:
    """The next-token candidates of one round's ``RequestOutput``."""
    (entry,) = output.outputs[0].logprobs
    return {t: lp.logprob for t, lp in entry.items()}


def search(searches: list[BeamSearch],
           run_round: Callable[[list[list[int]]], list[Any]]) -> None:
    """Run rounds until every search is done; ``run_round(prompts)`` returns one final
    ``RequestOutput`` per prompt (token ids), in order."""
    while live := [s for s in searches if not s.done]:
        _advance(live, run_round([ids for s in live for ids in s.requests()]))


async def search_async(searches: list[BeamSearch], run_round: Callable[..., Any]) -> None:
    """``search`` with an async ``run_round`` (the server's engine)."""
    while live := [s for s in searches if not s.done]:
        _advance(live, await run_round([ids for s in live for ids in s.requests()]))


def _advance(live: list[BeamSearch], outputs: list[Any]) -> None:
    k = 0
    for s in live:
        n = len(s.live)
        for out in outputs[k:k + n]:
            if getattr(out, "error", None) is not None:
                raise RuntimeError(f"beam search: a step of the search failed: {out.error}")
        s.advance([top_logprobs(o) for o in outputs[k:k + n]])
        k += n


async def beam_search_async(engine: Any, prompts: list[list[int]], params: BeamSearchParams,
                            eos_token_ids: Sequence[int], max_model_len: int,
                            decode: Callable[[list[int], list[int]], str] | None,
                            priority: int = 0, lora_request: Any = None
                            ) -> list[BeamSearchOutput]:
    """Beam search through an ``AsyncLLM`` (or data-parallel replicas): each round's
    requests go in together and are awaited together; cancelling this aborts them."""
    import itertools
    import uuid

    from cadence.async_stream import add_all, final_outputs
    from cadence.output_state import OutputKind

    searches = [BeamSearch(p, params, eos_token_ids, max_model_len) for p in prompts]
    step = step_params(params)
    base, ids = uuid.uuid4().hex, itertools.count()

    async def run_round(batch: list[list[int]]) -> list[Any]:
        return await final_outputs(await add_all(engine, [
            ({"prompt_token_ids": p}, step, f"beam-{base}-{next(ids)}", priority,
             OutputKind.FINAL_ONLY, lora_request) for p in batch]))

    await search_async(searches, run_round)
    return [s.output(decode) for s in searches]
