"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's extension): the
body's ``n`` beams, ranked by ``length_penalty``, searched with core/beam_search.py over the
same engine, returned as ``n`` choices.

Beam search ranks beams by the model's own log-probabilities: a body that also asks for
something that would change how tokens are picked (a temperature, top-p, penalties, a
seed, stop strings, a grammar) or for what a beam does not carry (logprobs, echo, a stream)
is refused with the field named, never half-honoured.
"""

from __future__ import annotations

from typing import Any

from cadence.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_async,
    detokenizer,
)
from cadence.sampling_params import FieldError
from cadence.server import formats
from cadence.server.limits import check_request_count
from cadence.server.protocol import RequestError

# Field -> what the body may send with beam search (None or a neutral value).
_NEUTRAL: dict[str, tuple] = {
    "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "seed": (None,), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "min_tokens": (0,), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "response_format": (None,), "prompt_logprobs": (None,), "stream": (False,),
    "include_stop_str_in_output": (False,),
    # /v1/completions
    "logprobs": (None, False), "echo": (False,),
    # /v1/chat/completions
    "top_logprobs": (None,), "tools": (None, []),
    "return_token_ids": (False,),
}


def check_beam_request(req: Any) -> None:
    """Refuse a beam-search body that asks for what beam search does not do."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise RequestError("length_penalty applies only with use_beam_search=true",
                               "length_penalty")
        return
    for name, neutral in _NEUTRAL.items():
        if name in type(req).model_fields and not _is_neutral(getattr(req, name), neutral):
            raise RequestError(f"{name} does not apply with use_beam_search=true: beams are "
                               "ranked by the model's own log-probabilities and returned "
                               "whole; leave it out", name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise RequestError("best_of must equal n or be omitted with use_beam_search=true",
                           "best_of")


def _is_neutral(value: Any, neutral: tuple) -> bool:
    # By type too: completions' logprobs=0 asks for the sampled token's logprob, though
    # 0 == False (chat's logprobs=false is neutral).
    return any(type(value) is type(n) and value == n for n in neutral)


class BeamServing:
    """Beam search for the two endpoints, over the same engine as ``OpenAIServing``."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self.engine = serving.engine

    def _params(self, req: Any, num_prompt: int, requested: int | None, field: str
                ) -> BeamSearchParams:
        max_tokens = self.serving._params(num_prompt, requested, lambda m: m, field)
        try:
            return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                                    ignore_eos=req.ignore_eos,
                                    length_penalty=req.length_penalty)
        except FieldError as e:
            raise RequestError(str(e), {"beam_width": "n"}.get(e.param, e.param)) from None

    async def _search(self, prompts: list[list[int]], params: BeamSearchParams,
                      req: Any) -> list[BeamSearchOutput]:
        check_request_count(self.engine, params.beam_width * len(prompts), "n")
        return await beam_search_async(self.engine, prompts, params, self.engine.eos_token_ids,
                                       self.serving.max_model_len,
                                       detokenizer(self.serving.tokenizer, req.skip_special_tokens,
                                                   req.spaces_between_special_tokens),
                                       req.priority, self.serving.check_model(req.model))

    def _admit(self, req: Any) -> Any:
        """The checks of either endpoint's body; returns the ``OpenAIServing``."""
        s = self.serving
        s.check_model(req.model)
        s.limits.check(req)
        req.check(s.max_logprobs)
        check_beam_request(req)
        return s

    async def completion_body(self, req: Any) -> dict:
        s = self._admit(req)
        prompts = [p["prompt_token_ids"] for p in s.completion_prompts(req)]
        params = self._params(req, max(map(len, prompts)), req.max_tokens, "prompt")
        outs = await self._search(prompts, params, req)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, out in enumerate(outs):
            usage["prompt_tokens"] += len(out.prompt_token_ids)
            for j, seq in enumerate(out.sequences):
                usage["completion_tokens"] += len(seq.output_token_ids)
                choices.append(formats.completion_choice(i * req.n + j, seq.text, None,
                                                         seq.finish_reason, None))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return formats.envelope("cmpl", "text_completion", s.response_model(req), choices, usage,
                                req.request_id)

    async def chat_body(self, req: Any) -> dict:
        s = self._admit(req)
        prompt = s.chat_prompt(req)["prompt_token_ids"]
        params = self._params(req, len(prompt), req.requested_max_tokens, "messages")
        (out,) = await self._search([prompt], params, req)
        reply = s._reply(req)
        choices = []
        for j, seq in enumerate(out.sequences):
            fields, finish = reply.whole(seq.text, seq.finish_reason)
            choices.append({"index": j, "message": {"role": "assistant", **fields},
                            "logprobs": None, "finish_reason": finish, "stop_reason": None})
        n_out = sum(len(q.output_token_ids) for q in out.sequences)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                 "total_tokens": len(prompt) + n_out}
        return formats.envelope("chatcmpl", "chat.completion", s.response_model(req), choices,
                                usage, req.request_id)
