"""The model's recommended sampling defaults from its ``generation_config.json``, applied
the way vLLM applies them (docs/semantics.md).

``--generation-config auto`` (the default) reads the model folder's file, a folder path
reads that folder's file, and ``none`` (or vLLM's spelling, ``vllm``) ignores it. The values
fill the sampling fields a request leaves out; a field the request sets always wins.
"""

from __future__ import annotations

import json
import os

from cadence.config import GENERATION_DEFAULT_FIELDS, ModelConfig
from cadence.sampling_params import SamplingParams

GENERATION_CONFIG_CHOICES = ("auto", "none", "vllm")

GenerationDefaults = tuple[tuple[str, object], ...]


def load_generation_defaults(model: str, generation_config: str = "auto"
                             ) -> GenerationDefaults:
    """The sampling defaults ``generation_config`` selects for ``model``, as (field, value)
    pairs in ``GENERATION_DEFAULT_FIELDS`` order; raises ValueError for a bad choice or file.

    Every field the file sets (not null) applies, whatever its value: transformers'
    ``generate()`` would use it too (``top_k: 50`` included). ``do_sample`` is ignored, as
    vLLM ignores it, and so is ``max_new_tokens``: cadence's ``max_tokens`` defaults belong to
    each front end (docs/server.md).
    """
    if not isinstance(generation_config, str) or not generation_config:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES} or a "
                         f"folder holding generation_config.json, got {generation_config!r}")
    if generation_config in ("none", "vllm"):
        return ()
    folder = model if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config == "auto":
            return ()
        # An explicit folder without the file is a typo, not "no defaults".
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES} or a "
                         f"folder holding generation_config.json; {generation_config!r} "
                         "has no generation_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e}); pass --generation-config none to "
                         "ignore it") from None
    if not isinstance(cfg, dict):
        raise ValueError(  # noqa: TRY004 (a user mistake is a ValueError: STYLE.md)
            f"{path} must hold a JSON object, got {type(cfg).__name__}")
    raw = {k: cfg[k] for k in GENERATION_DEFAULT_FIELDS if cfg.get(k) is not None}
    try:
        params = SamplingParams(**raw)
    except ValueError as e:
        raise ValueError(f"{path} sets an invalid sampling default: {e}; pass "
                         "--generation-config none to ignore the file") from None
    # The validated values: plain floats and ints (top_k -1 already turned into 0).
    return tuple((k, getattr(params, k)) for k in raw)


def load_eos_ids(model: str, generation_config: str = "auto") -> tuple[int, ...] | None:
    """The EOS ids generation stops on, as transformers' ``generate()`` finds them: the
    generation config's ``eos_token_id`` (the file ``generation_config`` selects, as for the
    defaults; ``none`` ignores it), else config.json's; None when neither names one (the
    tokenizer's EOS is then the one). A value that is no token id is a ValueError naming
    the file; null entries in a list are skipped, as transformers skips them."""
    if generation_config not in ("none", "vllm"):
        folder = model if generation_config == "auto" else generation_config
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            # load_generation_defaults read it first: a JSON object, or refused there.
            with open(path) as f:
                ids = _eos_list(json.load(f).get("eos_token_id"), path)
            if ids:
                return ids
    path = os.path.join(model, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    if eos is None and isinstance(cfg.get("text_config"), dict):
        eos = cfg["text_config"].get("eos_token_id")
    return _eos_list(eos, path) or None


def _eos_list(value: object, path: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0)
           for v in values):
        hint = "; pass --generation-config none to ignore the file" \
            if os.path.basename(path) == "generation_config.json" else ""
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got "
                         f"{value!r}{hint}")
    return tuple(v for v in values if v is not None)


def default_sampling_params(model_config: ModelConfig) -> SamplingParams:
    """What a request without SamplingParams gets: cadence's defaults overlaid with the
    model's (vLLM's ``LLM.get_default_sampling_params``)."""
    return SamplingParams(**dict(model_config.generation_defaults))


def describe_generation_defaults(defaults: GenerationDefaults,
                                 switch: str = "--generation-config none") -> str | None:
    """The start-up line naming the defaults that apply, or None when there are none."""
    if not defaults:
        return None
    values = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in defaults)
    return f"generation defaults from generation_config.json: {values} (pass {switch} to ignore)"
