"""OpenAI request bodies, validated with pydantic, and their mapping to ``SamplingParams``:
the fields both endpoints share and /v1/completions' body here, the chat body in
chat_protocol.py.

Unknown fields are rejected (a misspelt ``max_token`` must not be silently ignored), and
OpenAI fields cadence does not implement (``suffix``) are
rejected with a message naming them, never ignored; OpenAI fields that ask nothing of a
local server (``store``, ``metadata``...) are accepted. A JSON null takes the field's
default, as OpenAI's spec makes those fields nullable. Structured output arrives as OpenAI's
``response_format`` or vLLM's ``structured_outputs`` object and older ``guided_*`` fields, on
both endpoints (vLLM takes ``response_format`` on completions too); see
docs/structured_output.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from cadence.config import GENERATION_DEFAULT_FIELDS
from cadence.field_errors import token_id_key
from cadence.sampling_params import FieldError, SamplingParams
from cadence.structured_output.params import StructuredOutputsParams

# Entries one request's logit_bias may hold: each is work on every step the request is in,
# and one request's cost must not become every batch's.
MAX_LOGIT_BIAS = 1024

# Fields whose null says something of its own rather than "the default".
_NULL_MEANS_ITSELF = frozenset({"max_tokens"})

# vLLM's older request fields -> StructuredOutputsParams fields.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def check_logprobs_count(name: str, value: int | None, max_logprobs: int) -> None:
    """A body's count of top tokens (``logprobs``, ``top_logprobs``, ``prompt_logprobs``)
    against the server's ``--max-logprobs``: vLLM's -1 asks for the whole vocabulary, which
    only a server started with ``--max-logprobs -1`` gives."""
    if value is None:
        return
    if value == -1 and max_logprobs != -1:
        raise RequestError(f"{name}=-1 asks for the whole vocabulary; this server gives at "
                           f"most {max_logprobs} (it is started with --max-logprobs -1 to "
                           "allow it)", name)
    if value < -1 or (max_logprobs != -1 and value > max_logprobs):
        most = "the vocabulary size" if max_logprobs == -1 else str(max_logprobs)
        minus = ", or -1 (the whole vocabulary)" if max_logprobs == -1 else ""
        raise RequestError(f"{name} must be in [0, {most}]{minus}, got {value}", name)


class RequestError(ValueError):
    """A bad request: HTTP ``status`` with an OpenAI-shaped error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class _Body(BaseModel):
    """A request body's object: a JSON null takes the field's default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # Clients that send every field send null for those they leave alone (OpenAI's spec
        # makes them nullable); max_tokens keeps its null, which means the rest of the
        # context.
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields
                    or k in _NULL_MEANS_ITSELF or fields[k].default is None}
        return data


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class _Common(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    # strict: the types mean what SamplingParams's mean (docs/validation.md). Lax parsing
    # would take true as 1 (n, max_tokens, token ids), "3" and 3.0 as 3, and "yes" as true;
    # a JSON integer still fills a float field.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, same names.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's beam search: n beams, ranked by length-penalized log-probability
    # (core/server/beam.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the prompt's and each choice's token ids in the response.
    return_token_ids: bool = False
    # vLLM's: whether tokenizing the prompt adds the tokenizer's special tokens (a BOS);
    # None: yes for a completion's text, no for a rendered chat (its template places them).
    add_special_tokens: bool | None = None
    # vLLM's: the caller's id for the request (the response's id, and the engine's).
    request_id: str | None = None

    def _structured(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the body asks for, from whichever field."""
        asked: dict[str, StructuredOutputsParams] = {}
        name = "structured_outputs"
        try:
            if self.structured_outputs is not None:
                asked[name] = StructuredOutputsParams.from_dict(self.structured_outputs)
            for name, kind in _GUIDED.items():  # the loop variable names the field in errors
                if getattr(self, name) is not None:
                    asked[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
            name = "response_format"
            if self.response_format is not None:
                fmt = _response_format(self.response_format)
                if fmt is not None:
                    asked[name] = fmt
        except ValueError as e:
            message = str(e) if name in str(e) else f"{name}: {e}"
            raise RequestError(message, name) from None
        if len(asked) > 1:
            raise RequestError(f"only one of {sorted(asked)} may be given",
                               sorted(asked)[1])
        return next(iter(asked.values()), None)

    @property
    def structured_field(self) -> str:
        """The body field that asks for structured output, for the errors of its grammar."""
        names = ["structured_outputs", *_GUIDED, "response_format"]
        return next((n for n in names if getattr(self, n) is not None),
                    "structured_outputs")

    def _check_common(self, max_logprobs: int) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true",
                               "stream_options")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise RequestError(f"truncate_prompt_tokens must be an integer >= 1, -1 (the "
                               f"context less one token) or null, got {k}",
                               "truncate_prompt_tokens")
        if self.prompt_logprobs is not None:
            check_logprobs_count("prompt_logprobs", self.prompt_logprobs, max_logprobs)
            if self.stream:
                # vLLM's rule: a stream's chunks have no place for them.
                raise RequestError("prompt_logprobs is not available with stream=true",
                                   "prompt_logprobs")

    def _sampling(self, max_tokens: int, logprobs: int | None,
                  defaults: dict[str, Any] | None,
                  structured: StructuredOutputsParams | None = None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        logit_bias = self._logit_bias()
        # A field left out or sent as null takes the model's default (generation_config.json)
        # and then SamplingParams' own, as in vLLM; a value the body sends always wins.
        chosen = {**(defaults or {}), **{k: getattr(self, k) for k in GENERATION_DEFAULT_FIELDS
                                         if getattr(self, k) is not None}}
        try:
            return SamplingParams(
                n=self.n, seed=self.seed, **chosen,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=structured,
                logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                prompt_logprobs=prompt_logprobs,
                truncate_prompt_tokens=self.truncate_prompt_tokens)
        except FieldError as e:
            raise RequestError(str(e), self.body_field(e.param)) from None
        except ValueError as e:  # a check without a param: its message starts with the field
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias``: token ids as JSON object keys (strings) -> biases."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got "
                               f"{len(self.logit_bias)}", "logit_bias")
        out = {}
        for key, bias in self.logit_bias.items():
            token = token_id_key(key)
            if token is None:
                raise RequestError(f"logit_bias keys must be token ids (strings of at most "
                                   f"18 digits without leading zeros, such as \"50256\"), "
                                   f"got {key[:40]!r}", "logit_bias")
            out[token] = bias
        return out

    def body_field(self, name: str) -> str:
        """The body field behind the Python API's ``name`` (a ``FieldError``'s param)."""
        return name


    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string or one token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        if any(not x for x in p):
            raise RequestError("prompt must not be empty (one of its prompts is)", "prompt")
        return list(p)

    def check(self, max_logprobs: int) -> None:
        self._check_common(max_logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be >= 1 or null (0 only with echo=true, "
                               "which then returns the prompt alone)", "max_tokens")
        if self.suffix:
            raise RequestError("suffix is not supported by cadence", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of must equal n ({self.n}) or be omitted; cadence does "
                               "not rank extra samples", "best_of")
        check_logprobs_count("logprobs", self.logprobs, max_logprobs)

    @property
    def echo_only(self) -> bool:
        """echo=true with max_tokens=0: the response is the prompt alone (vLLM's form of
        OpenAI's scoring request); one token is generated and not returned."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` fill the sampling fields it leaves out.
        echo=true with logprobs asks for the prompt's logprobs too."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # -1 (the whole vocabulary) is the widest either may ask for.
            prompt_logprobs = -1 if -1 in (prompt_logprobs, self.logprobs) else \
                max(prompt_logprobs or 0, self.logprobs)
        return self._sampling(1 if self.echo_only else max_tokens, self.logprobs, defaults,
                              self._structured(), prompt_logprobs)


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""
    # Checked like the body's own fields: a misspelt key must not be silently ignored.
    _known_keys("response_format", fmt, {"type", "json_schema"})
    if isinstance(fmt.get("json_schema"), dict):
        _known_keys("response_format json_schema", fmt["json_schema"],
                    {"name", "description", "schema", "strict"})
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError("response_format json_schema needs "
                             "{'json_schema': {'name': ..., 'schema': {...}}}")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                     f"got {kind!r}")


def _known_keys(where: str, obj: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; allowed: {sorted(known)}")
