"""The bad-input table: every rule of docs/validation.md as data, with valid edge cases beside
the bad ones. tests/test_bad_input_table.py walks it through the Python API and over HTTP.

A case names the field its error must mention, or ``SERVED`` when the request must run to
the end. ``params`` are ``SamplingParams`` keyword arguments; over HTTP the same keys go into
the JSON body (their names are the OpenAI/vLLM ones). ``prompt`` is the Python prompt; over
HTTP a ``{"prompt_token_ids": ids}`` dict becomes ``"prompt": ids``. ``request`` holds the
other arguments of ``LLMEngine.add_request`` (``priority`` also goes into the body), or of
``LLM.generate`` for ``GENERATE`` cases. ``body`` is merged last into the HTTP body (``OMIT``
removes a key); the chat cases are written in it. ``on`` says which surfaces a case exists
on: a value the other surface cannot carry (numpy scalars, ``request_id``, ``detokenize``)
or whose meaning differs there (JSON ``null`` is "the default" for some fields) is
one-sided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cadence import SamplingParams

SERVED = "served"

# A tool of the chat cases, and tool_choice naming it.
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
_NAMED = {"type": "function", "function": {"name": "f"}}

BOTH = "both"            # LLMEngine.add_request and POST /v1/completions
PYTHON = "python"        # LLMEngine.add_request only
GENERATE = "generate"    # LLM.generate only
HTTP = "http"            # POST /v1/completions only
CHAT = "chat"            # POST /v1/chat/completions only
SURFACES = (BOTH, PYTHON, GENERATE, HTTP, CHAT)

# The engine the table runs against: small limits keep the edge cases cheap.
MAX_MODEL_LEN = 64
MAX_NUM_SAMPLES = 4
MAX_LOGPROBS = 20  # the server's default --max-logprobs

PROMPT = "the cat sat"
IDS = list(range(3, 13))  # a 10-token prompt: MAX_MODEL_LEN - 10 tokens of room
ROOM = MAX_MODEL_LEN - len(IDS)
# Every case asks for this many tokens unless it says otherwise: served cases stay quick.
MAX_TOKENS = 2


@dataclass(frozen=True)
class Vocab:
    """The model's vocabulary size plus ``offset``, filled in when the table runs."""

    offset: int = 0


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT = _Omit()


@dataclass(frozen=True)
class Case:
    id: str
    expect: str
    params: dict = field(default_factory=dict)
    prompt: Any = PROMPT
    request: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict)
    on: str = BOTH


def resolve(value: Any, vocab: int) -> Any:
    """``value`` with every ``Vocab`` replaced by a number (lists, tuples, dicts walked)."""
    if isinstance(value, Vocab):
        return vocab + value.offset
    if isinstance(value, list):
        return [resolve(v, vocab) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve(v, vocab) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, vocab) for k, v in value.items()}
    return value


def _ids(ids: Any) -> dict:
    return {"prompt_token_ids": ids}


NAN, INF = float("nan"), float("inf")
SEED_MAX, SEED_MIN = 2**63 - 1, -(2**63)

CASES: list[Case] = [
    # ---- n (and best_of, which only the server knows) ------------------------------------
    Case("n-zero", "n", {"n": 0}),
    Case("n-negative", "n", {"n": -3}),
    Case("n-float", "n", {"n": 2.0}),
    Case("n-bool", "n", {"n": True}),
    Case("n-string", "n", {"n": "2"}),
    Case("n-none", "n", {"n": None}, on=PYTHON),
    # Over HTTP a null is the field's default (OpenAI's nullable fields; clients send them).
    Case("n-null-is-default", SERVED, {"n": None}, on=HTTP),
    Case("n-over-max", "n", {"n": MAX_NUM_SAMPLES + 1}),
    Case("n-huge", "n", {"n": 10**9}),
    Case("n-at-max", SERVED, {"n": MAX_NUM_SAMPLES}),
    Case("n-numpy", SERVED, {"n": np.int64(2)}, on=PYTHON),
    Case("best_of-above-n", "best_of", body={"best_of": 3}, on=HTTP),
    Case("best_of-zero", "best_of", body={"best_of": 0}, on=HTTP),
    Case("best_of-string", "best_of", body={"best_of": "2"}, on=HTTP),
    Case("best_of-equal-n", SERVED, {"n": 2}, body={"best_of": 2}, on=HTTP),
    # ---- temperature (HTTP may cap it at 2: no case above 2 runs over HTTP) --------------
    Case("temperature-negative", "temperature", {"temperature": -0.5}),
    Case("temperature-nan", "temperature", {"temperature": NAN}),
    Case("temperature-inf", "temperature", {"temperature": INF}),
    Case("temperature-string", "temperature", {"temperature": "hot"}),
    Case("temperature-nan-string", "temperature", {"temperature": "NaN"}),
    Case("temperature-bool", "temperature", {"temperature": True}),
    Case("temperature-none", "temperature", {"temperature": None}, on=PYTHON),
    # An int past float's range: math.isfinite would raise OverflowError.
    Case("temperature-int-past-float", "temperature", {"temperature": 10**400}),
    Case("temperature-null-is-default", SERVED, {"temperature": None}, on=HTTP),
    Case("temperature-zero", SERVED, {"temperature": 0}),
    Case("temperature-int", SERVED, {"temperature": 1}),
    Case("temperature-large", SERVED, {"temperature": 50.0}, on=PYTHON),
    Case("temperature-numpy", SERVED, {"temperature": np.float32(0.5)}, on=PYTHON),
    # ---- top_p, top_k, min_p ------------------------------------------------------------
    Case("top_p-zero", "top_p", {"top_p": 0.0}),
    Case("top_p-above-one", "top_p", {"top_p": 1.5}),
    Case("top_p-negative", "top_p", {"top_p": -0.1}),
    Case("top_p-nan", "top_p", {"top_p": NAN}),
    Case("top_p-string", "top_p", {"top_p": "0.5"}),
    Case("top_p-one", SERVED, {"top_p": 1.0}),
    Case("top_p-tiny", SERVED, {"top_p": 1e-9}),
    Case("top_k-minus-three", "top_k", {"top_k": -3}),
    Case("top_k-float", "top_k", {"top_k": 2.5}),
    Case("top_k-bool", "top_k", {"top_k": True}),
    Case("top_k-string", "top_k", {"top_k": "5"}),
    Case("top_k-huge", "top_k", {"top_k": 10**20}),
    Case("top_k-vocab-plus-one", "top_k", {"top_k": Vocab(1)}),
    Case("top_k-vocab", SERVED, {"top_k": Vocab(0)}),
    Case("top_k-minus-one", SERVED, {"top_k": -1}),
    Case("top_k-one", SERVED, {"top_k": 1}),
    Case("min_p-above-one", "min_p", {"min_p": 2.0}),
    Case("min_p-negative", "min_p", {"min_p": -0.1}),
    Case("min_p-nan", "min_p", {"min_p": NAN}),
    Case("min_p-one", SERVED, {"min_p": 1.0}),
    # ---- penalties ----------------------------------------------------------------------
    Case("presence_penalty-above", "presence_penalty", {"presence_penalty": 3.0}),
    Case("presence_penalty-minus-inf", "presence_penalty", {"presence_penalty": -INF}),
    Case("presence_penalty-string", "presence_penalty", {"presence_penalty": "1"}),
    Case("presence_penalty-none", "presence_penalty", {"presence_penalty": None}, on=PYTHON),
    Case("presence_penalty-null-is-default", SERVED, {"presence_penalty": None}, on=HTTP),
    Case("presence_penalty-edge", SERVED, {"presence_penalty": 2.0}),
    Case("frequency_penalty-below", "frequency_penalty", {"frequency_penalty": -2.5}),
    Case("frequency_penalty-bool", "frequency_penalty", {"frequency_penalty": True}),
    Case("frequency_penalty-edge", SERVED, {"frequency_penalty": -2.0}),
    Case("repetition_penalty-zero", "repetition_penalty", {"repetition_penalty": 0.0}),
    Case("repetition_penalty-negative", "repetition_penalty", {"repetition_penalty": -1.0}),
    Case("repetition_penalty-inf", "repetition_penalty", {"repetition_penalty": INF}),
    Case("repetition_penalty-nan", "repetition_penalty", {"repetition_penalty": NAN}),
    Case("repetition_penalty-tiny", SERVED, {"repetition_penalty": 1e-6}),
    Case("repetition_penalty-two", SERVED, {"repetition_penalty": 2.0}),
    # ---- max_tokens and min_tokens, against the context too (min_tokens only) -------------
    Case("max_tokens-zero", "max_tokens", {"max_tokens": 0}),
    Case("max_tokens-negative", "max_tokens", {"max_tokens": -1}),
    Case("max_tokens-float", "max_tokens", {"max_tokens": 3.0}),
    Case("max_tokens-bool", "max_tokens", {"max_tokens": True}),
    Case("max_tokens-string", "max_tokens", {"max_tokens": "16"}),
    # Past the context: served until the context is full (vLLM's rule).
    Case("max_tokens-past-context", SERVED, {"max_tokens": 1000}, _ids(IDS)),
    Case("max_tokens-room-plus-one", SERVED, {"max_tokens": ROOM + 1}, _ids(IDS)),
    Case("max_tokens-exactly-room", SERVED, {"max_tokens": ROOM}, _ids(IDS)),
    Case("max_tokens-none-is-rest", SERVED, {"max_tokens": None}, _ids(IDS)),
    Case("max_tokens-numpy", SERVED, {"max_tokens": np.int64(3)}, on=PYTHON),
    Case("min_tokens-negative", "min_tokens", {"min_tokens": -1}),
    Case("min_tokens-float", "min_tokens", {"min_tokens": 1.5}),
    Case("min_tokens-above-max_tokens", "min_tokens", {"min_tokens": 5, "max_tokens": 2}),
    Case("min_tokens-past-context", "min_tokens", {"min_tokens": ROOM + 1, "max_tokens": None},
         _ids(IDS)),
    Case("min_tokens-exactly-room", SERVED, {"min_tokens": ROOM, "max_tokens": None},
         _ids(IDS)),
    Case("min_tokens-equal-max_tokens", SERVED, {"min_tokens": 2, "max_tokens": 2}),
    # ---- logprobs (completions' integer; chat's bool + top_logprobs are below) ----------
    Case("logprobs-negative", "logprobs", {"logprobs": -2}),
    # vLLM's -1 asks for the whole vocabulary: the Python API gives it, a server only when
    # started with --max-logprobs -1 (the table's server keeps vLLM's default 20).
    Case("logprobs-whole-vocabulary", SERVED, {"logprobs": -1, "max_tokens": 1}, on=PYTHON),
    Case("logprobs-whole-vocabulary-http", "logprobs", {"logprobs": -1}, on=HTTP),
    Case("logprobs-float", "logprobs", {"logprobs": 2.0}),
    Case("logprobs-bool", "logprobs", {"logprobs": False}),
    Case("logprobs-huge", "logprobs", {"logprobs": 10**9}),
    Case("logprobs-above-server-max", "logprobs", {"logprobs": MAX_LOGPROBS + 1}, on=HTTP),
    Case("logprobs-server-max", SERVED, {"logprobs": MAX_LOGPROBS}, on=HTTP),
    Case("logprobs-vocab-plus-one", "logprobs", {"logprobs": Vocab(1)}, on=PYTHON),
    Case("logprobs-vocab", SERVED, {"logprobs": Vocab(0)}, on=PYTHON),
    Case("logprobs-zero", SERVED, {"logprobs": 0}),
    # ---- truncate_prompt_tokens (vLLM's): the last k tokens, k < max_model_len; -1 the most --
    Case("truncate_prompt_tokens-zero", "truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    Case("truncate_prompt_tokens-minus-two", "truncate_prompt_tokens",
         {"truncate_prompt_tokens": -2}),
    Case("truncate_prompt_tokens-context-less-one", SERVED,
         {"truncate_prompt_tokens": -1, "max_tokens": 1}, _ids([5] * (MAX_MODEL_LEN + 10))),
    Case("truncate_prompt_tokens-float", "truncate_prompt_tokens",
         {"truncate_prompt_tokens": 2.0}),
    Case("truncate_prompt_tokens-context", "truncate_prompt_tokens",
         {"truncate_prompt_tokens": MAX_MODEL_LEN}, on=PYTHON),
    Case("truncate_prompt_tokens-long-prompt", SERVED, {"truncate_prompt_tokens": 8},
         _ids([5] * (MAX_MODEL_LEN + 10))),
    Case("truncate_prompt_tokens-longer-than-prompt", SERVED, {"truncate_prompt_tokens": 40}),
    # ---- prompt_logprobs (vLLM's): the same rule as logprobs; not in a stream ------------
    Case("prompt_logprobs-negative", "prompt_logprobs", {"prompt_logprobs": -2}),
    Case("prompt_logprobs-whole-vocabulary", SERVED, {"prompt_logprobs": -1}, on=PYTHON),
    Case("prompt_logprobs-whole-vocabulary-http", "prompt_logprobs",
         {"prompt_logprobs": -1}, on=HTTP),
    Case("prompt_logprobs-float", "prompt_logprobs", {"prompt_logprobs": 1.0}),
    Case("prompt_logprobs-bool", "prompt_logprobs", {"prompt_logprobs": True}),
    Case("prompt_logprobs-string", "prompt_logprobs", {"prompt_logprobs": "2"}),
    Case("prompt_logprobs-above-server-max", "prompt_logprobs",
         {"prompt_logprobs": MAX_LOGPROBS + 1}, on=HTTP),
    Case("prompt_logprobs-server-max", SERVED, {"prompt_logprobs": MAX_LOGPROBS}, on=HTTP),
    Case("prompt_logprobs-vocab-plus-one", "prompt_logprobs",
         {"prompt_logprobs": Vocab(1)}, on=PYTHON),
    Case("prompt_logprobs-vocab", SERVED, {"prompt_logprobs": Vocab(0)}, on=PYTHON),
    Case("prompt_logprobs-zero", SERVED, {"prompt_logprobs": 0}),
    Case("prompt_logprobs-stream", "prompt_logprobs", {"prompt_logprobs": 1},
         body={"stream": True}, on=HTTP),
    Case("chat-prompt_logprobs", SERVED, body={"prompt_logprobs": 2}, on=CHAT),
    Case("chat-prompt_logprobs-negative", "prompt_logprobs", body={"prompt_logprobs": -2},
         on=CHAT),
    # ---- seed: 64-bit signed ------------------------------------------------------------
    Case("seed-float", "seed", {"seed": 1.5}),
    Case("seed-string", "seed", {"seed": "7"}),
    Case("seed-bool", "seed", {"seed": True}),
    Case("seed-2**70", "seed", {"seed": 2**70, "temperature": 1.0}),
    Case("seed-below-int64", "seed", {"seed": SEED_MIN - 1}),
    # Past Python's int-to-str limit (4300 digits): repr() in the message would raise.
    Case("seed-10**5000", "seed", {"seed": 10**5000}, on=PYTHON),
    Case("seed-int64-max", SERVED, {"seed": SEED_MAX, "temperature": 1.0}),
    Case("seed-int64-min", SERVED, {"seed": SEED_MIN, "temperature": 1.0}),
    Case("seed-int64-max-n2", SERVED, {"seed": SEED_MAX, "n": 2, "temperature": 1.0}),
    Case("seed-negative", SERVED, {"seed": -1, "temperature": 1.0}),
    # ---- flags --------------------------------------------------------------------------
    Case("ignore_eos-string", "ignore_eos", {"ignore_eos": "yes"}),
    Case("ignore_eos-int", "ignore_eos", {"ignore_eos": 1}),
    Case("skip_special_tokens-none", "skip_special_tokens", {"skip_special_tokens": None},
         on=PYTHON),
    Case("skip_special_tokens-null-is-default", SERVED, {"skip_special_tokens": None},
         on=HTTP),
    Case("spaces_between_special_tokens-int", "spaces_between_special_tokens",
         {"spaces_between_special_tokens": 1}),
    Case("spaces_between_special_tokens-false", SERVED,
         {"spaces_between_special_tokens": False, "skip_special_tokens": False}),
    Case("include_stop_str_in_output-string", "include_stop_str_in_output",
         {"include_stop_str_in_output": "no"}),
    Case("include_stop_str_in_output-true", SERVED,
         {"include_stop_str_in_output": True, "stop": ["a"]}),
    Case("detokenize-int", "detokenize", {"detokenize": 1}, on=PYTHON),
    Case("detokenize-off-with-stop", "detokenize", {"detokenize": False, "stop": ["x"]},
         on=PYTHON),
    Case("detokenize-off", SERVED, {"detokenize": False}, on=PYTHON),
    Case("output_kind-string", "output_kind", {"output_kind": "delta"}, on=PYTHON),
    Case("output_kind-int", "output_kind", {"output_kind": 1}, on=PYTHON),
    # ---- stop strings -------------------------------------------------------------------
    Case("stop-empty-string-in-list", "stop", {"stop": [""]}),
    Case("stop-empty-string", "stop", {"stop": ""}),
    Case("stop-int-in-list", "stop", {"stop": [3]}),
    Case("stop-int", "stop", {"stop": 3}),
    Case("stop-lone-surrogate", "stop", {"stop": ["ok", "\ud800"]}),
    Case("stop-nested-list", "stop", {"stop": [["a"]]}),
    Case("stop-dict", "stop", {"stop": {"a": 1}}),
    Case("stop-bytes", "stop", {"stop": b"ab"}, on=PYTHON),
    Case("stop-set", "stop", {"stop": {"a"}}, on=PYTHON),
    Case("stop-empty-list", SERVED, {"stop": []}),
    Case("stop-none", SERVED, {"stop": None}),
    Case("stop-very-long", SERVED, {"stop": ["x" * 5000]}),
    Case("stop-many", SERVED, {"stop": [f"s{i}" for i in range(500)]}),
    Case("stop-tuple", SERVED, {"stop": ("a", "b")}, on=PYTHON),
    # ---- stop_token_ids -----------------------------------------------------------------
    Case("stop_token_ids-negative", "stop_token_ids", {"stop_token_ids": [-1]}),
    Case("stop_token_ids-float", "stop_token_ids", {"stop_token_ids": [1.0]}),
    Case("stop_token_ids-bool", "stop_token_ids", {"stop_token_ids": [True]}),
    Case("stop_token_ids-string-id", "stop_token_ids", {"stop_token_ids": ["3"]}),
    Case("stop_token_ids-int", "stop_token_ids", {"stop_token_ids": 5}),
    Case("stop_token_ids-string", "stop_token_ids", {"stop_token_ids": "12"}),
    Case("stop_token_ids-out-of-vocab", "stop_token_ids", {"stop_token_ids": [10**6]}),
    Case("stop_token_ids-vocab", "stop_token_ids", {"stop_token_ids": [Vocab(0)]}),
    Case("stop_token_ids-2**70", "stop_token_ids", {"stop_token_ids": [2**70]}),
    Case("stop_token_ids-10**5000", "stop_token_ids", {"stop_token_ids": [10**5000]},
         on=PYTHON),
    Case("stop_token_ids-out-of-vocab-below-min_tokens", "stop_token_ids",
         {"stop_token_ids": [10**6], "min_tokens": 2}),
    Case("stop_token_ids-last-id", SERVED, {"stop_token_ids": [Vocab(-1)], "min_tokens": 1}),
    Case("stop_token_ids-empty", SERVED, {"stop_token_ids": []}),
    Case("stop_token_ids-numpy", SERVED, {"stop_token_ids": [np.int64(3)]}, on=PYTHON),
    # ---- prompts ------------------------------------------------------------------------
    Case("prompt-empty", "prompt", prompt=""),
    Case("prompt-none", "prompt", prompt=None),
    Case("prompt-int", "prompt", prompt=5),
    Case("prompt-float", "prompt", prompt=3.5),
    Case("prompt-empty-ids", "prompt", prompt=[]),
    Case("prompt-lone-surrogate", "prompt", prompt="lone \udc80 surrogate"),
    Case("prompt-too-long-text", "prompt", prompt="the cat sat " * 60),
    Case("prompt-too-long-ids", "prompt", prompt=_ids([5] * MAX_MODEL_LEN)),
    Case("prompt-longest", SERVED, {"max_tokens": 1}, prompt=_ids([5] * (MAX_MODEL_LEN - 1))),
    Case("prompt-whitespace", SERVED, prompt=" "),
    Case("prompt-dict-wrong-key", "prompt", prompt={"text": "x"}),
    Case("prompt-dict-extra-key", "prompt", prompt={"prompt": "x", "prompt_token_idz": [3]},
         on=PYTHON),
    Case("prompt-dict-text-not-str", "prompt", prompt={"prompt": 5}, on=PYTHON),
    Case("prompt-dict-ids-beside-int-text", "prompt",
         prompt={"prompt": 5, "prompt_token_ids": [3]}, on=PYTHON),
    Case("prompt-dict-ids-none", "prompt_token_ids", prompt=_ids(None), on=PYTHON),
    Case("prompt-dict-ids-bytes", "prompt_token_ids", prompt=_ids(b"\x03\x04"), on=PYTHON),
    Case("prompt-dict-ids-int", "prompt_token_ids", prompt=_ids(7), on=PYTHON),
    Case("prompt-dict-ids-strings", "prompt_token_ids", prompt=_ids(["3"]), on=PYTHON),
    Case("prompt-dict-ids-nested", "prompt_token_ids", prompt=_ids([[3, 4]]), on=PYTHON),
    Case("prompt-dict-ids-numpy-array", "prompt_token_ids", prompt=_ids(np.array([3, 4])),
         on=PYTHON),
    Case("prompt-dict-ids-and-text", SERVED, prompt={"prompt": "ab", "prompt_token_ids": [3]},
         on=PYTHON),
    Case("prompt-ids-float", "prompt", prompt=_ids([3, 4.0])),
    Case("prompt-ids-bool", "prompt", prompt=_ids([3, True])),
    Case("prompt-ids-negative", "prompt", prompt=_ids([3, -1])),
    Case("prompt-ids-out-of-vocab", "prompt", prompt=_ids([10**6])),
    Case("prompt-ids-vocab", "prompt", prompt=_ids([Vocab(0)])),
    Case("prompt-ids-last-id", SERVED, prompt=_ids([3, Vocab(-1)])),
    Case("prompt-ids-nested", "prompt_token_ids", prompt=[[3, 4]], on=PYTHON),
    Case("prompt-ids-bytes", "prompt", prompt=b"\x03\x04", on=PYTHON),
    Case("prompt-ids-tuple", SERVED, prompt=(3, 4), on=PYTHON),
    Case("prompt-ids-numpy", SERVED, prompt=_ids([np.int64(3), np.int32(4)]), on=PYTHON),
    # ---- the rest of the request --------------------------------------------------------
    Case("request_id-int", "request_id", request={"request_id": 7}, on=PYTHON),
    Case("request_id-none", "request_id", request={"request_id": None}, on=PYTHON),
    Case("params-dict", "params", request={"params": {"max_tokens": 2}}, on=PYTHON),
    Case("params-none-is-default", SERVED, request={"params": None}, on=PYTHON),
    Case("priority-string", "priority", request={"priority": "high"}),
    Case("priority-float", "priority", request={"priority": 1.5}),
    Case("priority-bool", "priority", request={"priority": True}),
    Case("priority-none", "priority", request={"priority": None}, on=PYTHON),
    # The table's engine schedules fcfs, where only the default priority is accepted.
    Case("priority-nonzero-under-fcfs", "priority", request={"priority": 1}),
    Case("priority-huge-negative-under-fcfs", "priority", request={"priority": -10**30}),
    Case("priority-too-long-to-print", "priority", request={"priority": 10**5000}, on=PYTHON),
    Case("n-too-long-to-print", "n", {"n": 10**5000}, on=PYTHON),
    Case("max-tokens-too-long-to-print", SERVED, {"max_tokens": 10**5000}, on=PYTHON),
    Case("min-tokens-too-long-to-print", "min_tokens", {"min_tokens": 10**5000}, on=PYTHON),
    Case("priority-zero", SERVED, request={"priority": 0}),
    Case("priority-numpy", SERVED, request={"priority": np.int64(0)}, on=PYTHON),
    # ---- LLM.generate's own arguments ---------------------------------------------------
    Case("generate-prompts-none", "prompts", request={"prompts": None}, on=GENERATE),
    Case("generate-prompts-int", "prompts", request={"prompts": 5}, on=GENERATE),
    Case("generate-prompts-bytes", "prompts", request={"prompts": b"ab"}, on=GENERATE),
    Case("generate-prompts-empty", SERVED, request={"prompts": []}, on=GENERATE),
    Case("generate-prompts-numpy-ids", SERVED,
         request={"prompts": [np.int64(3), np.int64(4)]}, on=GENERATE),
    Case("generate-bad-prompt-in-batch", "prompt", request={"prompts": ["fine", ""]},
         on=GENERATE),
    Case("generate-sampling_params-dict", "sampling_params",
         request={"prompts": ["x"], "sampling_params": {"max_tokens": 2}}, on=GENERATE),
    Case("generate-sampling_params-list-of-dicts", "sampling_params",
         request={"prompts": ["x", "y"],
                  "sampling_params": [SamplingParams(max_tokens=2), {"max_tokens": 2}]},
         on=GENERATE),
    Case("generate-sampling_params-wrong-length", "sampling_params",
         request={"prompts": ["x", "y"], "sampling_params": [SamplingParams(max_tokens=2)]},
         on=GENERATE),
    Case("generate-priority-int", "priority", request={"prompts": ["x"], "priority": 5},
         on=GENERATE),
    Case("generate-priority-wrong-length", "priority",
         request={"prompts": ["x", "y"], "priority": [0]}, on=GENERATE),
    Case("generate-priority-string-entry", "priority",
         request={"prompts": ["x"], "priority": ["high"]}, on=GENERATE),
    # ---- /v1/completions only -----------------------------------------------------------
    Case("http-prompt-missing", "prompt", body={"prompt": OMIT}, on=HTTP),
    Case("http-prompt-empty-batch-entry", "prompt", body={"prompt": [[]]}, on=HTTP),
    Case("http-prompt-ids-then-empty", "prompt", body={"prompt": [[3, 4], []]}, on=HTTP),
    Case("http-prompt-text-then-empty", "prompt", body={"prompt": ["ok", ""]}, on=HTTP),
    Case("http-prompt-mixed-list", "prompt", body={"prompt": [1, "a"]}, on=HTTP),
    Case("http-prompt-nested-strings", "prompt", body={"prompt": [["a"]]}, on=HTTP),
    Case("http-prompt-second-out-of-vocab", "prompt", body={"prompt": [[3, 4], [10**6]]},
         on=HTTP),
    Case("http-prompt-id-batch", SERVED, body={"prompt": [[3, 4], [5, 6]]}, on=HTTP),
    Case("http-prompt-text-batch", SERVED, body={"prompt": ["a b", "c d"]}, on=HTTP),
    Case("http-echo", SERVED, body={"echo": True}, on=HTTP),
    Case("http-echo-logprobs", SERVED, body={"echo": True, "logprobs": 2}, on=HTTP),
    Case("http-echo-max_tokens-zero", SERVED, body={"echo": True, "max_tokens": 0,
                                                    "logprobs": 1}, on=HTTP),
    Case("http-echo-string", "echo", body={"echo": "yes"}, on=HTTP),
    Case("http-suffix", "suffix", body={"suffix": "x"}, on=HTTP),
    # ---- logit_bias: token id -> bias in [-100, 100]; JSON object keys are strings ------
    Case("logit_bias-forced", SERVED, {"logit_bias": {5: 100.0}}),
    Case("logit_bias-int-bias", SERVED, {"logit_bias": {5: -100, 6: 3}}),
    Case("logit_bias-empty", SERVED, {"logit_bias": {}}),
    Case("logit_bias-numpy", SERVED, {"logit_bias": {np.int64(5): np.float32(2.5)}},
         on=PYTHON),
    Case("logit_bias-over-100", "logit_bias", {"logit_bias": {5: 100.5}}),
    Case("logit_bias-under-minus-100", "logit_bias", {"logit_bias": {5: -101}}),
    Case("logit_bias-nan", "logit_bias", {"logit_bias": {5: NAN}}, on=PYTHON),
    Case("logit_bias-string-bias", "logit_bias", {"logit_bias": {5: "up"}}),
    Case("logit_bias-bool-bias", "logit_bias", {"logit_bias": {5: True}}),
    Case("logit_bias-negative-id", "logit_bias", {"logit_bias": {-1: 1.0}}),
    Case("logit_bias-bool-id", "logit_bias", {"logit_bias": {True: 1.0}}),
    Case("logit_bias-string-id", "logit_bias", {"logit_bias": {"5": 1.0}}, on=PYTHON),
    Case("logit_bias-id-out-of-vocab", "logit_bias", {"logit_bias": {10**6: 1.0}}),
    Case("logit_bias-list", "logit_bias", {"logit_bias": [5]}),
    Case("http-logit_bias", SERVED, body={"logit_bias": {"1": 2}}, on=HTTP),
    # ---- allowed_token_ids: vLLM's whitelist of what may be sampled -------------------
    Case("allowed_token_ids", SERVED, {"allowed_token_ids": [5, 6, 7]}),
    Case("allowed_token_ids-duplicates", SERVED, {"allowed_token_ids": [5, 5]}),
    Case("allowed_token_ids-empty", "allowed_token_ids", {"allowed_token_ids": []}),
    Case("allowed_token_ids-negative", "allowed_token_ids", {"allowed_token_ids": [-1]}),
    Case("allowed_token_ids-bool", "allowed_token_ids", {"allowed_token_ids": [True]}),
    Case("allowed_token_ids-string", "allowed_token_ids", {"allowed_token_ids": "5"}),
    Case("allowed_token_ids-float", "allowed_token_ids", {"allowed_token_ids": [5.0]}),
    Case("allowed_token_ids-out-of-vocab", "allowed_token_ids",
         {"allowed_token_ids": [5, 10**6]}),
    Case("allowed_token_ids-with-grammar", "allowed_token_ids",
         {"allowed_token_ids": [5], "structured_outputs": {"regex": "a"}}),
    Case("allowed_token_ids-only-eos-under-min_tokens", SERVED,
         {"allowed_token_ids": [1], "min_tokens": 2}),
    Case("http-logit_bias-key-not-an-id", "logit_bias", body={"logit_bias": {"abc": 1}},
         on=HTTP),
    Case("http-logit_bias-key-huge", "logit_bias", body={"logit_bias": {"9" * 5000: 1}},
         on=HTTP),
    Case("http-logit_bias-key-leading-zero", "logit_bias", body={"logit_bias": {"05": 1}},
         on=HTTP),
    Case("http-logit_bias-key-zero", SERVED, body={"logit_bias": {"0": 1}}, on=HTTP),
    Case("http-logit_bias-key-like-a-type", "logit_bias", body={"logit_bias": {"str": 1}},
         on=HTTP),
    Case("http-logit_bias-too-many", "logit_bias",
         body={"logit_bias": {str(i): 1 for i in range(1025)}}, on=HTTP),
    Case("http-stream_options-without-stream", "stream_options",
         body={"stream_options": {"include_usage": True}}, on=HTTP),
    Case("http-stream_options-string-flag", "stream_options",
         body={"stream": True, "stream_options": {"include_usage": "yes"}}, on=HTTP),
    Case("http-stream-string", "stream", body={"stream": "yes"}, on=HTTP),
    Case("http-unknown-field", "max_token", body={"max_token": 3}, on=HTTP),
    Case("http-detokenize-is-not-a-field", "detokenize", body={"detokenize": False}, on=HTTP),
    Case("http-user-int", "user", body={"user": 5}, on=HTTP),
    Case("http-model-int", "model", body={"model": 5}, on=HTTP),
    Case("http-max_tokens-null-is-rest", SERVED, body={"max_tokens": None}, on=HTTP),
    # ---- /v1/chat/completions only ------------------------------------------------------
    Case("chat-messages-empty", "messages", body={"messages": []}, on=CHAT),
    Case("chat-messages-missing", "messages", body={"messages": OMIT}, on=CHAT),
    Case("chat-messages-string", "messages", body={"messages": "hi"}, on=CHAT),
    Case("chat-role-empty", "messages", body={"messages": [{"role": "",
                                                            "content": "x"}]}, on=CHAT),
    # Roles are the template's business, as in vLLM (Llama 3.1's "ipython").
    Case("chat-role-the-template-knows", SERVED,
         body={"messages": [{"role": "ipython", "content": "x"}]}, on=CHAT),
    # What OpenAI's SDK puts on an assistant message it returned comes back with it.
    Case("chat-assistant-message-as-the-sdk-dumps-it", SERVED, body={"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "refusal": None, "annotations": None,
         "audio": None, "function_call": None, "reasoning_content": "z"},
        {"role": "user", "content": [{"type": "text", "text": "w",
                                      "cache_control": {"type": "ephemeral"}}]}]}, on=CHAT),
    Case("chat-function_call-in-a-message", "messages", body={"messages": [
        {"role": "assistant", "content": "y", "function_call": {"name": "f"}}]}, on=CHAT),
    Case("chat-openai-fields-a-local-server-ignores", SERVED, body={
        "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u",
        "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
        "reasoning_effort": "low", "modalities": ["text"]}, on=CHAT),
    Case("chat-modalities-audio", "modalities", body={"modalities": ["text", "audio"]},
         on=CHAT),
    Case("chat-functions-deprecated", "functions", body={"functions": [{"name": "f"}]},
         on=CHAT),
    Case("chat-top_logprobs-zero-without-logprobs", SERVED, body={"top_logprobs": 0},
         on=CHAT),
    Case("chat-content-int", "messages", body={"messages": [{"role": "user", "content": 5}]},
         on=CHAT),
    Case("chat-content-part-image", "messages",
         body={"messages": [{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": "x"}]}]}, on=CHAT),
    Case("chat-message-extra-key", "messages",
         body={"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, on=CHAT),
    Case("chat-logprobs-int", "logprobs", body={"logprobs": 5}, on=CHAT),
    Case("chat-logprobs-string", "logprobs", body={"logprobs": "yes"}, on=CHAT),
    Case("chat-top_logprobs-without-logprobs", "top_logprobs", body={"top_logprobs": 2},
         on=CHAT),
    Case("chat-top_logprobs-above-max", "top_logprobs",
         body={"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, on=CHAT),
    Case("chat-top_logprobs-negative", "top_logprobs",
         body={"logprobs": True, "top_logprobs": -1}, on=CHAT),
    Case("chat-top_logprobs-float", "top_logprobs",
         body={"logprobs": True, "top_logprobs": 2.5}, on=CHAT),
    Case("chat-top_logprobs-max", SERVED, body={"logprobs": True, "top_logprobs": MAX_LOGPROBS},
         on=CHAT),
    Case("chat-logprobs-alone", SERVED, body={"logprobs": True}, on=CHAT),
    Case("chat-max_completion_tokens-zero", "max_completion_tokens",
         body={"max_completion_tokens": 0}, on=CHAT),
    Case("chat-max_completion_tokens-string", "max_completion_tokens",
         body={"max_completion_tokens": "4"}, on=CHAT),
    # Past the context: cut to what it holds (vLLM's server).
    Case("chat-max_tokens-past-context", SERVED, body={"max_tokens": 1000}, on=CHAT),
    Case("chat-max_completion_tokens-past-context", SERVED,
         body={"max_completion_tokens": 1000}, on=CHAT),
    Case("chat-max_tokens-zero-beside-max_completion_tokens", "max_tokens",
         body={"max_tokens": 0, "max_completion_tokens": 3}, on=CHAT),
    Case("chat-max_tokens-negative", "max_tokens", body={"max_tokens": -1}, on=CHAT),
    Case("chat-max_completion_tokens", SERVED, body={"max_completion_tokens": 3}, on=CHAT),
    # ---- tools (core/server/tools.py); "auto" needs a server started with a parser ------
    Case("chat-tools", "tools", body={"tools": [{"type": "function"}]}, on=CHAT),
    Case("chat-tool_choice", "tool", body={"tool_choice": "auto"}, on=CHAT),
    Case("chat-tools-auto-without-parser", "tool_choice", body={"tools": [_TOOL]}, on=CHAT),
    Case("chat-tools-none", SERVED, body={"tools": [_TOOL], "tool_choice": "none"}, on=CHAT),
    Case("chat-tools-named", SERVED, body={"tools": [_TOOL], "tool_choice": _NAMED},
         on=CHAT),
    Case("chat-tools-named-unknown", "tool_choice",
         body={"tools": [_TOOL], "tool_choice": {"type": "function",
                                                 "function": {"name": "g"}}}, on=CHAT),
    Case("chat-tools-required-without-tools", "tool_choice", body={"tool_choice": "required"},
         on=CHAT),
    Case("chat-tools-duplicate-names", "tools", body={"tools": [_TOOL, _TOOL],
                                                      "tool_choice": "none"}, on=CHAT),
    Case("chat-tools-named-beside-response_format", "tool_choice",
         body={"tools": [_TOOL], "tool_choice": _NAMED,
               "response_format": {"type": "json_object"}}, on=CHAT),
    Case("chat-tools-parameters-not-object", "tools",
         body={"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
               "tool_choice": "none"}, on=CHAT),
    Case("chat-tool-message-without-id", SERVED,
         body={"messages": [{"role": "user", "content": "x"},
                            {"role": "tool", "content": "y"}]}, on=CHAT),
    Case("chat-response_format-json", SERVED,
         body={"response_format": {"type": "json_object"}}, on=CHAT),
    Case("chat-response_format-yaml", "response_format",
         body={"response_format": {"type": "yaml"}}, on=CHAT),
    Case("chat-response_format-schema-missing", "response_format",
         body={"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         on=CHAT),
    Case("chat-response_format-unknown-key", "response_format",
         body={"response_format": {"type": "json_object", "schema": {}}}, on=CHAT),
    Case("chat-response_format-json_schema-misspelt-key", "response_format",
         body={"response_format": {"type": "json_schema", "json_schema": {
             "name": "x", "schema": {"type": "object"}, "strictt": True}}}, on=CHAT),
    Case("chat-guided_choice-empty", "guided_choice", body={"guided_choice": []}, on=CHAT),
    # The engine parses the grammar; its error must name the field the body used.
    Case("http-guided_regex-unparsable", "guided_regex", body={"guided_regex": "("}, on=HTTP),
    Case("http-guided_grammar-no-root", "guided_grammar", body={"guided_grammar": "x"},
         on=HTTP),
    Case("chat-response_format-schema-unsupported", "response_format",
         body={"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         on=CHAT),
    Case("structured_outputs-unparsable-regex", "structured_outputs",
         body={"structured_outputs": {"regex": "("}}, on=HTTP),
    Case("structured_outputs-two-kinds", "structured_outputs",
         params={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    Case("structured_outputs-bad-regex", "structured_outputs",
         params={"structured_outputs": {"regex": "(a"}}, on=PYTHON),
    Case("structured_outputs-regex", SERVED, params={"structured_outputs": {"regex": "ab?"}}),
    Case("chat-response_format-text", SERVED, body={"response_format": {"type": "text"}},
         on=CHAT),
    # vLLM takes response_format on /v1/completions too; the same rules hold there.
    Case("http-response_format-json", SERVED,
         body={"response_format": {"type": "json_object"}}, on=HTTP),
    Case("http-response_format-yaml", "response_format",
         body={"response_format": {"type": "yaml"}}, on=HTTP),
    Case("http-response_format-beside-guided_regex", "response_format",
         body={"response_format": {"type": "json_object"}, "guided_regex": "a"}, on=HTTP),
    Case("chat-add_generation_prompt-string", "add_generation_prompt",
         body={"add_generation_prompt": "x"}, on=CHAT),
    Case("chat-n-over-max", "n", body={"n": MAX_NUM_SAMPLES + 1}, on=CHAT),
    Case("chat-stop-int", "stop", body={"stop": [3]}, on=CHAT),
    Case("chat-temperature-negative", "temperature", body={"temperature": -1}, on=CHAT),
    Case("chat-seed-2**70", "seed", body={"seed": 2**70}, on=CHAT),
    Case("chat-n-two", SERVED, body={"n": 2, "temperature": 0.7, "seed": 3}, on=CHAT),
    Case("chat-developer-role", SERVED,
         body={"messages": [{"role": "developer", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
         on=CHAT),
]
