"""Per-request sampling parameters, named and validated like vLLM's."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

# The field errors' names stay importable from here, where they always were.
from cadence.field_errors import FieldError, is_valid_unicode, shown
from cadence.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Seeds are 64-bit signed, as in vLLM's server: a backend may hold them in an int64 tensor.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class OutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything so far, every step
    DELTA = "delta"  # only what is new since the previous output (streaming)
    FINAL_ONLY = "final"  # one output, at the end (LLM.generate)


RequestOutputKind = OutputKind  # vLLM's name for it


def resolve_output_kind(given: OutputKind | None, params: object,
                        default: OutputKind) -> OutputKind:
    """The kind a request's outputs take: the one passed to ``add_request`` or
    ``generate``, else its params' ``output_kind`` (vLLM's field), else the API's
    default."""
    if given is not None:
        if not isinstance(given, OutputKind):
            kinds = ", ".join(k.name for k in OutputKind)
            raise FieldError(f"output_kind must be an OutputKind ({kinds}) or None, got "
                             f"{shown(given)}", "output_kind")
        return given
    return getattr(params, "output_kind", None) or default


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output.

    Every invalid value raises ``ValueError`` naming the field and the allowed range, so a
    server can turn it into an HTTP 400 without guessing: a ``FieldError`` with the field in
    ``param``, except for the contents of ``structured_outputs``, which
    ``StructuredOutputsParams`` checks.

    ``temperature == 0`` means greedy. ``seed`` makes the request's samples reproducible
    whatever else shares its batch and whether async output processing is on. With ``n > 1``
    and a seed, sample ``i`` uses ``seed + i`` (vLLM's convention); ``seed=-1`` means no
    fixed seed, as in vLLM.
    ``logprobs=k`` returns, per generated token, the sampled token's log-probability plus the
    ``k`` most likely tokens, computed from the raw model logits (before penalties and
    temperature, as vLLM V1 does by default).
    ``logprobs=-1`` (and ``prompt_logprobs=-1``) asks for the whole vocabulary, as in vLLM.
    ``logit_bias`` maps token ids to a number in [-100, 100] added to their logits before
    penalties and sampling (OpenAI's field; -100 in effect bans a token, +100 all but forces
    it). The returned logprobs are the model's own, from before the bias.
    ``allowed_token_ids`` restricts sampling to those tokens (vLLM's field), applied before
    the bias.
    ``bad_words`` (vLLM's field): each word is tokenized as it reads alone and after a space;
    the last token of such a sequence may not be sampled where the output's last tokens
    are the rest of it (a one-token word never). Only output tokens count, as in vLLM.
    ``truncate_prompt_tokens=k`` keeps the prompt's last ``k`` tokens (vLLM's field: left
    truncation, for inputs longer than the context; -1 keeps as many as the context holds
    with room for one output token, ``max_model_len - 1``); a text prompt keeps the special
    tokens its tokenizer adds (a BOS) and loses its first tokens, as vLLM's tokenizer cuts
    it. The request's ``prompt`` stays the text.
    ``prompt_logprobs=k`` returns, per prompt token after the first, its log-probability
    given the tokens before it plus the ``k`` most likely tokens there (vLLM's field; the
    first entry is None, nothing predicts it). The prompt is then computed in full: a
    request asking for them takes no prefix-cache hits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: False writes an added token that follows another without a space between
    # them (only where special tokens are kept, skip_special_tokens=False).
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Constrains the output to a JSON schema, regex, choice or grammar
    # (docs/structured_output.md).
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM's field): the token that would complete one is
    # banned where the output's last tokens begin it.
    bad_words: list[str] | None = None
    # What each output carries (vLLM's field); None: the API's default
    # (docs/architecture.md, "Output kinds").
    # An ``output_kind`` passed to ``add_request`` or ``generate`` takes precedence.
    output_kind: OutputKind | None = None
    # Filled by the engine: the longest stop string, to size the streaming hold-back.
    output_text_buffer_length: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        # Only lists and tuples: list() of an int fails with a TypeError, and of a dict or a
        # string of digits it would quietly make stop values out of keys or characters.
        for name, allowed in (("stop", "a string or a list of non-empty strings"),
                              ("stop_token_ids", "a list of non-negative token ids")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise FieldError(f"{name} must be {allowed} or None, got "
                                 f"{type(value).__name__} {shown(value):.40}", name)
            setattr(self, name, list(value or []))
        self._validate()
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None  # vLLM's: -1 asks for no fixed seed
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> FieldError:
            return FieldError(f"{name} must be {allowed}, got {shown(getattr(self, name))}",
                              name)

        # numbers.Integral/Real admit numpy scalars; values are stored as plain int/float.
        # bool is an int subclass, but True is not a token count.
        def integer(name: str, allowed: str, ok, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not ok(v):
                raise bad(name, allowed)
            setattr(self, name, int(v))

        def number(name: str, allowed: str, ok) -> None:
            v = getattr(self, name)
            if (not isinstance(v, numbers.Real) or isinstance(v, bool)
                    or not _is_finite(v) or not ok(v)):
                raise bad(name, allowed)
            setattr(self, name, float(v))

        def flag(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")

        integer("n", "an integer >= 1", lambda v: v >= 1)
        number("temperature", "a finite number >= 0 (0 means greedy)", lambda v: v >= 0.0)
        number("top_p", "a number in (0, 1]", lambda v: 0.0 < v <= 1.0)
        integer("top_k", "0 or -1 (disabled) or a positive integer", lambda v: v >= -1)
        number("min_p", "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        number("presence_penalty", "a number in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        number("frequency_penalty", "a number in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        number("repetition_penalty", "a finite number > 0", lambda v: v > 0.0)
        integer("max_tokens", "an integer >= 1 or None", lambda v: v >= 1, optional=True)
        integer("min_tokens", "an integer >= 0", lambda v: v >= 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({shown(self.max_tokens)})")
        for name in ("logprobs", "prompt_logprobs"):
            integer(name, "None, -1 (the whole vocabulary) or an integer >= 0",
                    lambda v: v >= -1, optional=True)
        integer("truncate_prompt_tokens", "None, -1 (the context less one token) or an "
                "integer >= 1", lambda v: v >= 1 or v == -1, optional=True)
        integer("seed", "None or a 64-bit integer, in [-2**63, 2**63 - 1]",
                lambda v: SEED_MIN <= v <= SEED_MAX, optional=True)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            flag(name)
        if any(not isinstance(s, str) or not s or not is_valid_unicode(s) for s in self.stop):
            raise bad("stop", "a list of non-empty strings (valid Unicode, no lone surrogates)")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() or not is_valid_unicode(w)
                for w in words)):
            raise bad("bad_words", "None, a string or a list of strings that are not blank "
                      "(valid Unicode)")
        if words is not None:
            self.bad_words = list(words) or None
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0
               for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self._validate_logit_bias()
        ids = self.allowed_token_ids
        if ids is not None:
            if (not isinstance(ids, (list, tuple)) or not ids
                    or any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0
                           for t in ids)):
                raise bad("allowed_token_ids", "None or a non-empty list of token ids "
                          "(integers >= 0)")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        if self.output_kind is not None and not isinstance(self.output_kind, OutputKind):
            raise bad("output_kind", "an OutputKind (" + ", ".join(k.name for k in OutputKind)
                      + ") or None")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if not isinstance(so, dict):
                raise bad("structured_outputs", "a StructuredOutputsParams, a dict of its "
                          "fields, or None")
            self.structured_outputs = StructuredOutputsParams.from_dict(so)
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            # Two lists of what may come next that could leave nothing to sample.
            raise FieldError("allowed_token_ids cannot be combined with structured_outputs: "
                             "the grammar decides which tokens may come", "allowed_token_ids")

    def _validate_logit_bias(self) -> None:
        lb = self.logit_bias
        if lb is None:
            return
        allowed = "a dict of token ids (integers >= 0) to biases in [-100, 100], or None"
        if not isinstance(lb, dict):
            raise FieldError(f"logit_bias must be {allowed}, got {type(lb).__name__} "
                             f"{shown(lb):.40}", "logit_bias")
        clean: dict[int, float] = {}
        for token, bias in lb.items():
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
                raise FieldError(f"logit_bias must be {allowed}; {shown(token)} is not a token "
                                 "id", "logit_bias")
            if (not isinstance(bias, numbers.Real) or isinstance(bias, bool)
                    or not _is_finite(bias) or not -100.0 <= bias <= 100.0):
                raise FieldError(f"logit_bias must be {allowed}; token {int(token)} has "
                                 f"{shown(bias)}", "logit_bias")
            clean[int(token)] = float(bias)
        self.logit_bias = clean or None

    def for_vocabulary(self, vocab_size: int | None) -> SamplingParams:
        """These params with vLLM's -1 for ``logprobs`` / ``prompt_logprobs`` spelled out as
        the model's vocabulary size (self where neither asks for it)."""
        if -1 not in (self.logprobs, self.prompt_logprobs):
            return self
        name = "logprobs" if self.logprobs == -1 else "prompt_logprobs"
        if not vocab_size:
            raise FieldError(f"{name}=-1 asks for the whole vocabulary, and this model does not "
                             "give its vocabulary size; ask for a number of tokens", name)
        from dataclasses import replace

        return replace(self, logprobs=vocab_size if self.logprobs == -1 else self.logprobs,
                       prompt_logprobs=vocab_size if self.prompt_logprobs == -1
                       else self.prompt_logprobs)

    def check_against_model(self, vocab_size: int | None) -> None:
        """The checks that need the model: token ids and counts against its vocabulary."""
        if not vocab_size:
            return
        if self.top_k > vocab_size:
            raise FieldError(f"top_k must be <= the vocabulary size ({vocab_size}) or 0/-1 "
                             f"(disabled), got {shown(self.top_k)}", "top_k")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise FieldError(f"{name} must be <= the vocabulary size ({vocab_size}), "
                                 f"got {shown(value)}", name)
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logit_bias token ids", self.logit_bias or ())):
            bad_ids = [t for t in ids if t >= vocab_size]
            if bad_ids:
                raise FieldError(f"{name} must be in [0, {vocab_size}), got "
                                 f"{shown(bad_ids[:5])}", name.split()[0])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the ``index``-th of ``n`` samples: n=1, and seed + index (wrapped
        into the 64-bit range, so seed=2**63-1 with n=2 stays a valid seed)."""
        from dataclasses import replace

        seed = None if self.seed is None else _wrap_seed(self.seed + index)
        out = replace(self, n=1, seed=seed)
        out.seed = seed  # a sample's -1 (seed -2, sample 1) is a seed, not "none"
        return out


def _is_finite(value: numbers.Real) -> bool:
    # math.isfinite raises OverflowError for an int past float's range (10**400).
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _wrap_seed(seed: int) -> int:
    return (seed - SEED_MIN) % 2**64 + SEED_MIN
