"""The model side of attention: a layer hands q/k/v to the backend's paged attention
through the forward context, with the keywords its family needs.

NOTE attention features: a layer passes ``sliding_window``, ``scale`` and ``soft_cap`` by
keyword, and only when they differ from the defaults every backend implements (the whole
causal context, ``head_dim ** -0.5``, no cap). A backend whose ``AttentionImpl.forward`` predates a feature then
still runs every model that does not need it, and refuses one that does with an error
naming the feature, instead of attending the default way.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from cadence.forward_context import get_forward_context

_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def attention_features(head_dim: int, sliding_window: int | None = None,
                       scale: float | None = None,
                       soft_cap: float | None = None) -> dict[str, Any]:
    """The keywords a layer passes to ``AttentionImpl.forward`` (module NOTE): a window when
    it has one, a scale when it is not ``head_dim ** -0.5``, a soft cap C when the scores
    are capped (``C * tanh(score / C)`` after scaling, before the mask and softmax: Gemma 2's
    ``attn_logit_softcapping``)."""
    features: dict[str, Any] = {}
    if sliding_window is not None:
        features["sliding_window"] = sliding_window
    if scale is not None and scale != head_dim ** -0.5:
        features["scale"] = float(scale)
    if soft_cap is not None:
        features["soft_cap"] = float(soft_cap)
    return features


def attention_keywords(model: torch.nn.Module) -> set[str]:
    """Every attention keyword some layer of ``model`` passes, so a backend can pick an
    attention path that implements them before the first forward."""
    return {key for module in model.modules()
            for key in (getattr(module, "features", None) or {})}


def check_supported(attn: Any, model: torch.nn.Module) -> None:
    """Refuse, at start-up, a model whose layers pass an attention keyword that ``attn``'s
    ``forward`` does not take: the backend could only fail at the first forward (``attend``
    still says why for a backend that never calls this)."""
    params = inspect.signature(attn.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = sorted(attention_keywords(model) - set(params))
    if missing:
        raise ValueError(
            f"this model's attention needs {', '.join(missing)}, which this backend's "
            f"attention ({type(attn).__name__}) does not implement; run it on a backend "
            "that does (docs/models.md)")


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
