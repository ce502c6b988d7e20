"""What a model folder's config.json allows that cadence must respect before loading it.
No torch here: the engine's configuration is resolved before any backend starts."""

from __future__ import annotations

import json
import os


def _config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)


def check_architecture(model: str) -> None:
    """Refuse a model whose config.json names only architectures cadence cannot load, with
    the supported list. A missing or unreadable config.json, or one without
    ``architectures``, is left to the checks that report those."""
    from cadence.models import supported_architectures  # the registry imports no torch

    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return
    architectures = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not isinstance(architectures, list) or not architectures:
        return
    supported = supported_architectures()
    if not any(arch in supported for arch in architectures):
        names = ", ".join(map(str, architectures))
        raise ValueError(f"model {model!r}: unsupported architecture {names}; cadence "
                         f"supports {', '.join(supported)}")


def longest_context(model: str) -> tuple[int | None, str]:
    """The longest max_model_len the model's positions allow, and why.

    ``max_position_embeddings``, unless RoPE scaling stretches it, as vLLM reads it: YaRN
    covers ``original_max_position_embeddings * factor``, dynamic NTK
    ``max_position_embeddings * factor`` (the rotary cache computes those positions the way
    transformers does, core/layers/rotary.py).
    """
    cfg = _config(model)
    max_pos = cfg.get("max_position_embeddings")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if not max_pos or kind not in ("yarn", "dynamic") or not isinstance(factor, (int, float)):
        return max_pos, f"max_position_embeddings ({max_pos})"
    base = (rope.get("original_max_position_embeddings") or max_pos) if kind == "yarn" \
        else max_pos
    longest = max(max_pos, int(base * factor))
    return longest, (f"{base} positions x the {kind} RoPE factor {factor:g} = {longest}"
                     if longest > max_pos else f"max_position_embeddings ({max_pos})")


def sliding_window(model: str) -> int | None:
    """The attention window in tokens if some layer of the model attends to a window only
    (Mistral's ``sliding_window``, Qwen2's with ``use_sliding_window``, per-layer
    ``layer_types`` such as Gemma's); None for full attention everywhere."""
    cfg = _config(model)
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None  # Qwen2/Qwen3 ship a window but leave it off
    return window


def check_sliding_window(model: str, max_len: int, explicit: bool) -> int:
    """The max_model_len to use: cadence attends to the whole context, which equals
    windowed attention exactly while no sequence is longer than the window. So a default
    length is capped at the window (and says so), and a longer explicit one is refused."""
    window = sliding_window(model)
    if window is None or max_len <= window:
        return max_len
    if explicit:
        raise ValueError(
            f"max_model_len={max_len} is longer than the model's sliding attention window "
            f"({window} tokens), and cadence does not implement windowed attention yet: "
            f"past the window its output would differ from the model's; pass "
            f"--max-model-len {window} or less")
    print(f"cadence: max_model_len capped at the model's sliding attention window ({window} "
          "tokens): cadence attends to the whole context, which is exact only within it")
    return window
