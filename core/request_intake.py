"""What the engine checks and derives before a request exists: the prompt's token ids, the
request's limits against the model and the engine, and the model's EOS ids. No torch."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from cadence.config import SchedulerConfig
from cadence.sampling_params import FieldError, SamplingParams, is_valid_unicode, shown


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[int] | dict
                ) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt as users pass it; a ValueError naming what is
    wrong (a ``FieldError`` with ``param="prompt"``)."""
    if isinstance(prompt, dict):
        # A misspelt key ("prompt_token_id") must not leave the other one used silently.
        unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
        if unknown:
            raise FieldError(f"a prompt dict takes the keys 'prompt' and "
                             f"'prompt_token_ids', got {unknown}", "prompt")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise FieldError(f"prompt must be a string, got {type(text).__name__}", "prompt")
        if "prompt_token_ids" in prompt:
            return text, token_list(prompt["prompt_token_ids"])
        if text is None:
            raise FieldError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        prompt = text
    if isinstance(prompt, str):
        if not prompt:
            raise FieldError("prompt must not be empty", "prompt")
        if not is_valid_unicode(prompt):
            raise FieldError("prompt must be valid Unicode text (it has a lone surrogate)",
                             "prompt")
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        raise FieldError("prompt must be a string, a list of token ids or a dict with "
                         f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}",
                         "prompt")
    return None, token_list(prompt)

def validate_request(ids: list[int], params: SamplingParams, sc: SchedulerConfig,
                 vocab: int | None) -> None:
    """Refuse a request the engine could not run as asked: a ``FieldError`` (a ValueError)
    naming the field, the token ids as ``prompt``."""
    max_len = sc.max_model_len
    k = truncation_length(params.truncate_prompt_tokens, max_len)
    if k is not None and k >= max_len:
        raise FieldError(f"truncate_prompt_tokens must be < max_model_len={max_len} (to leave "
                         f"room for output), got {shown(k)}", "truncate_prompt_tokens")
    if params.n > sc.max_num_samples:
        raise FieldError(f"n must be <= max_num_samples ({sc.max_num_samples}), got "
                         f"{shown(params.n)}", "n")
    if not ids:
        raise FieldError("prompt must not be empty (it has no tokens)", "prompt")
    if len(ids) >= max_len:
        raise FieldError(f"prompt has {len(ids)} tokens; it must be shorter than "
                         f"max_model_len={max_len} to leave room for output", "prompt")
    # A max_tokens past the context is not refused, as in vLLM: the request ends with
    # "length" when the context is full. min_tokens past it could never be met.
    room = max_len - len(ids)
    if params.min_tokens > room:
        raise FieldError(f"min_tokens must be <= {room} (max_model_len={max_len} less "
                         f"the prompt's {len(ids)} tokens), got {shown(params.min_tokens)}",
                         "min_tokens")
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise FieldError(f"prompt_token_ids must be in [0, {vocab})", "prompt")
    params.check_against_model(vocab)
    if params.stop and not params.detokenize:
        raise FieldError("stop strings need detokenize=True", "detokenize")


def bad_words_token_ids(tokenizer: Any, words: list[str] | None,
                        vocab_size: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM makes them: as it reads alone, and after a
    space (how it is written mid-sentence) where that form is a word token of its own (its
    first token differs and its length does not; a tokenizer that splits off the space
    would otherwise ban the bare word after any space token). Duplicates once; a sequence
    with an id outside the model's vocabulary can never be sampled and is dropped."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words or ():
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        forms = [alone]
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            forms.append(spaced)
        for ids in forms:
            if ids and (vocab_size is None or max(ids) < vocab_size):
                seqs[ids] = None
    return tuple(seqs)


def truncation_length(k: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens=k`` keeps: ``k``, or with vLLM's -1
    the whole context less the one token every request samples (a prompt of
    ``max_model_len`` tokens would have no room for output); None keeps them all."""
    return max_model_len - 1 if k == -1 else k


def truncate_prompt(ids: list[int], k: int | None) -> list[int]:
    """The prompt's last ``k`` ids (``truncate_prompt_tokens``; all of them when None)."""
    return ids if k is None or len(ids) <= k else ids[-k:]


def truncate_text_prompt(tokenizer: Any, text: str, ids: list[int], k: int | None
                         ) -> list[int]:
    """A text prompt's ids (``ids``, its encoding) cut to ``k`` as vLLM cuts them, by the
    tokenizer's truncation from the left: the special tokens the tokenizer puts around the
    text (a BOS; BERT's CLS and SEP, which CLS pooling reads) stay, and the text's first
    tokens go. Where the text's own ids are not found whole among ``ids``, or the special
    tokens alone pass ``k``, the last ``k`` ids."""
    if k is None or len(ids) <= k:
        return ids
    body = tokenizer.encode(text, add_special_tokens=False)
    n = len(body)
    for start in range(len(ids) - n + 1):
        if ids[start:start + n] == body:
            keep = k - (len(ids) - n)
            if keep >= 0:
                return ids[:start] + body[n - keep:] + ids[start + n:]
            break
    return ids[-k:]


def vocab_size_from_config(model_dir: str) -> int | None:
    """``vocab_size`` from the model folder's config.json (or its text_config)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def eos_token_ids(tokenizer: Any, configured: tuple[int, ...] | None, vocab_size: int | None
                  ) -> tuple[int, ...]:
    """The EOS ids the model's configuration names (``ModelConfig.eos_token_ids``: the
    generation config's, as generate() stops on them; Llama 3 Instruct lists three; else
    config.json's), else the tokenizer's. Ids outside the vocabulary are dropped: the model
    can never sample them, and the sampler could not ban them below min_tokens."""
    ids: list = list(configured or ())
    if not ids:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eos is None else [eos]
    return tuple(t for t in dict.fromkeys(int(t) for t in ids)
                 if vocab_size is None or 0 <= t < vocab_size)


def token_list(ids: object) -> list[int]:
    """A prompt's token ids as a list of plain ints (numpy integers accepted); bytes,
    non-sequences, floats and bools are refused (ValueError)."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
        raise FieldError("prompt_token_ids must be a list of integers, got "
                         f"{type(ids).__name__}", "prompt")
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise FieldError(f"prompt_token_ids must be integers, got {t!r} "
                             f"({type(t).__name__})", "prompt")
    return [int(t) for t in ids]
