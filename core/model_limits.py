"""What a model folder's config.json allows that cadence must respect before loading it.
No torch here: the engine's configuration is resolved before any backend starts."""

from __future__ import annotations

import json
import os


def sliding_window(model: str) -> int | None:
    """The attention window in tokens if some layer of the model attends to a window only
    (Mistral's ``sliding_window``, Qwen2's with ``use_sliding_window``, per-layer
    ``layer_types`` such as Gemma's); None for full attention everywhere."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
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
