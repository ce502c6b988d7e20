"""How ``LLM``'s methods read their arguments: one prompt or a list, one parameter object for
every prompt or one each, vLLM's ``tokenization_kwargs``. Each refusal is a ``FieldError``
naming the argument.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from cadence.lora import LoRARequest
from cadence.sampling_params import FieldError


def prompt_list(prompts: Any) -> list:
    """One prompt (a string, token ids or a dict) or a list of them, as a list."""
    if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):
        raise FieldError("prompts must be a prompt (a string, a list of token ids or a "
                         "dict) or a list of prompts, got " + type(prompts).__name__,
                         "prompts")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                            and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    return list(prompts)


def per_prompt(given: Any, cls: type, name: str, n: int) -> list:
    """``given`` (one ``cls`` for every prompt, or a list with one per prompt) as a list."""
    if isinstance(given, cls):
        return [given] * n
    bad = given if not isinstance(given, (list, tuple)) else next(
        (p for p in given if not isinstance(p, cls)), None)
    if bad is not None:
        raise FieldError(f"{name} must be {cls.__name__}, a list of them (one per prompt) or "
                         f"None, got {type(bad).__name__}", name)
    if len(given) != n:
        raise FieldError(f"{name} has {len(given)} entries for {n} prompts; pass one, or one "
                         "per prompt", name)
    return list(given)


def with_tokenization(params: list, kwargs: dict[str, Any] | None) -> list:
    """vLLM's ``tokenization_kwargs`` of ``generate``: only ``truncate_prompt_tokens``
    changes how cadence tokenizes a prompt."""
    if kwargs is None:
        return params
    if not isinstance(kwargs, dict) or set(kwargs) - {"truncate_prompt_tokens"}:
        raise FieldError(f"tokenization_kwargs may hold truncate_prompt_tokens only, got "
                         f"{kwargs!r:.80}", "tokenization_kwargs")
    if "truncate_prompt_tokens" not in kwargs:
        return params
    k = kwargs["truncate_prompt_tokens"]
    return [dataclasses.replace(p, truncate_prompt_tokens=k) for p in params]


def per_lora(given: Any, n: int) -> list | None:
    """One LoRA request (or None) per prompt, from one for all or a list of them."""
    if given is None or isinstance(given, LoRARequest):
        return None if given is None else [given] * n
    if not isinstance(given, (list, tuple)) or len(given) != n:
        raise FieldError(f"lora_request must be a LoRARequest, None, or a list with one "
                         f"entry per prompt ({n}), got {given!r:.80}", "lora_request")
    return list(given)
