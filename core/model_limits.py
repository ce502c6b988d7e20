"""What a model folder's config.json allows that cadence must respect before loading it.
No torch here: the engine's configuration is resolved before any backend starts."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def _config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)


def check_architecture(model: str) -> None:
    """Refuse a model whose config.json names only architectures cadence cannot load, with
    the supported list; one without ``architectures`` is known by its ``model_type``, as
    transformers knows it. A missing or unreadable config.json is left to the checks that
    report those."""
    # The registry imports no torch.
    from cadence.models import architectures_of, supported_architectures

    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return
    if not isinstance(cfg, dict):  # every reader of the file expects an object
        raise ValueError(f"model {model!r}: config.json must hold a JSON object, got "  # noqa: TRY004
                         f"{type(cfg).__name__}")
    architectures = architectures_of(cfg.get("architectures"), cfg.get("model_type"))
    if not architectures:
        raise ValueError(f"model {model!r}: config.json names no architectures, and its "
                         f"model_type {cfg.get('model_type')!r} is none cadence knows; it "
                         f"supports {', '.join(supported_architectures())}")
    supported = supported_architectures()
    if not any(arch in supported for arch in architectures):
        names = ", ".join(map(str, architectures))
        raise ValueError(f"model {model!r}: unsupported architecture {names}; cadence "
                         f"supports {', '.join(supported)}")


def has_lm_head(model: str) -> bool:
    """False when config.json names only base models (``LlamaModel``, ...: checkpoints saved
    without their LM head, as embedding models are) and does not tie a head to the
    embeddings; such a model serves embeddings only."""
    from cadence.models import is_base_model

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return not is_base_model(cfg.get("architectures")) or bool(cfg.get("tie_word_embeddings"))


def longest_context(model: str) -> tuple[int | None, str]:
    """The longest max_model_len the model's positions allow, and why.

    ``max_position_embeddings``, unless RoPE scaling stretches it, as vLLM reads it: YaRN
    covers ``original_max_position_embeddings * factor``, dynamic NTK
    ``max_position_embeddings * factor`` (the rotary cache computes those positions the way
    transformers does, core/layers/rotary.py).
    """
    cfg = _config(model)
    # GPT-2's config.json names it n_positions (transformers maps the two).
    field = "n_positions" if "max_position_embeddings" not in cfg and "n_positions" in cfg \
        else "max_position_embeddings"
    max_pos = cfg.get(field)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if not max_pos or kind not in ("yarn", "dynamic") or not isinstance(factor, (int, float)):
        return max_pos, f"{field} ({max_pos})"
    base = (rope.get("original_max_position_embeddings") or max_pos) if kind == "yarn" \
        else max_pos
    longest = max(max_pos, int(base * factor))
    return longest, (f"{base} positions x the {kind} RoPE factor {factor:g} = {longest}"
                     if longest > max_pos else f"max_position_embeddings ({max_pos})")


# transformers' defaults where config.json leaves a field out (MistralConfig, Qwen2Config,
# Qwen3Config): the window of a Mistral whose config does not name one is 4096 tokens.
_DEFAULT_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


def layer_windows(cfg: Mapping[str, Any]) -> list[int | None]:
    """Each layer's attention window in tokens (None: the whole context), read the way
    transformers reads the config (its ``model_type`` picks the rule):

    - ``mistral``: every layer attends to ``sliding_window`` tokens; ``layer_types`` is
      ignored, as MistralModel ignores it (transformers points such configs to Ministral).
    - ``qwen2``, ``qwen3``: no window unless ``use_sliding_window``; then the layers that
      ``layer_types`` marks ``sliding_attention``, or without ``layer_types`` the layers from
      ``max_window_layers`` on (Qwen2Config's rule: the first ``max_window_layers`` are full).
    - ``phi3``: every layer attends to ``sliding_window`` tokens when the config sets one
      (Phi3Config's default is None; Phi-3-mini-4k sets 2047).
    - ``gemma2``, ``gemma3_text``: the layers ``layer_types`` marks ``sliding_attention``
      (transformers writes it; without it, Gemma 2 windows every other layer from the first
      on and Gemma 3 five of every ``sliding_window_pattern`` (6) layers).
    - anything else (Llama): full attention everywhere.

    A window of W tokens lets the query at position i see keys j with i - W < j <= i
    (transformers' ``sliding_window_overlay``: W keys, the query's own included).
    ``cfg`` is config.json's dict or a transformers config's ``to_dict()``.
    """
    num_layers = int(cfg.get("num_hidden_layers") or 0)
    kind = cfg.get("model_type")
    if kind == "mistral":
        window = cfg.get("sliding_window", _DEFAULT_WINDOW)
        return [_valid_window(window)] * num_layers
    if kind == "phi3":
        return [_valid_window(cfg.get("sliding_window"))] * num_layers
    if kind == "mixtral":  # MixtralModel windows every layer when the config sets one
        return [_valid_window(cfg.get("sliding_window"))] * num_layers
    if kind == "qwen3_moe":  # every layer, with use_sliding_window (Qwen3MoeConfig's rule)
        on = cfg.get("use_sliding_window")
        return [_valid_window(cfg.get("sliding_window")) if on else None] * num_layers
    if kind == "qwen2_moe":  # the layers layer_types marks (Qwen2MoeAttention's rule)
        window = _valid_window(cfg.get("sliding_window"))
        layer_types = cfg.get("layer_types")
        if not cfg.get("use_sliding_window") or window is None:
            return [None] * num_layers
        if not isinstance(layer_types, list):
            raise ValueError("a qwen2_moe config with use_sliding_window needs layer_types "
                             "(which layers are windowed); transformers writes it")
        return [window if t == "sliding_attention" else None for t in layer_types]
    if kind in ("gemma2", "gemma3_text"):
        window = _valid_window(cfg.get("sliding_window", _DEFAULT_WINDOW))
        layer_types = cfg.get("layer_types")
        if not isinstance(layer_types, list):
            pattern = 2 if kind == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        return [window if t == "sliding_attention" else None for t in layer_types]
    if kind in ("qwen2", "qwen3"):
        window = _valid_window(cfg.get("sliding_window", _DEFAULT_WINDOW))
        if not cfg.get("use_sliding_window") or window is None:
            return [None] * num_layers
        layer_types = cfg.get("layer_types")
        if not isinstance(layer_types, list):
            first = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(num_layers)]
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [None] * num_layers


def _valid_window(window: object) -> int | None:
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return window
    return None


def kv_window(windows: list[int | None]) -> int | None:
    """How many of the latest tokens any layer can still read, when every layer attends to a
    window (the largest window); None when some layer reads the whole context. KV blocks
    older than that are never read again and can be freed while a request runs."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def model_kv_window(model: str) -> int | None:
    """``kv_window`` of the model folder's config.json."""
    return kv_window(layer_windows(_config(model)))
