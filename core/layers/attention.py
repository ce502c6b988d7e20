"""The model side of attention: a layer hands q/k/v to the backend's paged attention
through the forward context, with the keywords its family needs.

NOTE attention features: a layer passes ``sliding_window`` and ``scale`` by keyword, and
only when they differ from the defaults every backend implements (the whole causal context,
``head_dim ** -0.5``). A backend whose ``AttentionImpl.forward`` predates a feature then
still runs every model that does not need it, and refuses one that does with an error
naming the feature, instead of attending the default way.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from cadence.forward_context import get_forward_context

_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def attention_features(head_dim: int, sliding_window: int | None = None,
                       scale: float | None = None) -> dict[str, Any]:
    """The keywords a layer passes to ``AttentionImpl.forward`` (module NOTE): a window when
    it has one, a scale when it is not ``head_dim ** -0.5``."""
    features: dict[str, Any] = {}
    if sliding_window is not None:
        features["sliding_window"] = sliding_window
    if scale is not None and scale != head_dim ** -0.5:
        features["scale"] = float(scale)
    return features


def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           features: dict[str, Any]) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D] through the current forward context."""
    ctx = get_forward_context()
    if not features:
        return ctx.attn.forward(layer_idx, q, k, v, ctx.metadata)
    try:
        return ctx.attn.forward(layer_idx, q, k, v, ctx.metadata, **features)
    except TypeError as exc:
        match = _UNEXPECTED.search(str(exc))
        if match is None or match.group(1) not in features:
            raise
        raise NotImplementedError(
            f"this model's attention needs {match.group(1)}={features[match.group(1)]!r}, "
            f"which the backend's attention ({type(ctx.attn).__name__}) does not implement; "
            "run it on a backend that does (docs/models.md)") from exc
