"""The one global of the engine: what the attention layers need during a forward pass.

The model code stays free of scheduling details: each attention layer asks the current
context to run attention for its layer index over the paged KV cache. The runner installs
the context with ``set_forward_context`` around one forward pass; nesting is a bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol


class AttentionImpl(Protocol):
    """What a backend provides so the model's attention layers can use its paged cache."""

    def forward(self, layer_idx: int, q: Any, k: Any, v: Any, metadata: Any,
                sliding_window: int | None = None, scale: float | None = None) -> Any:
        """Write ``k``/``v`` of this step into the cache, then attend.

        Shapes: ``q`` [num_tokens, num_heads, head_dim], ``k``/``v``
        [num_tokens, num_kv_heads, head_dim]; returns [num_tokens, num_heads, head_dim].

        ``sliding_window`` W: the query at position i attends to keys at positions
        i - W < j <= i only (transformers' rule: W keys, its own included); None, the whole
        causal context. Layers pass it by keyword, and only when they have a window, so an
        implementation without the parameter fails loudly on a windowed model instead of
        attending to too much. Keys older than the window may sit in blocks the engine has
        already freed (their table entries then name block 0): never read them.

        ``scale``: the factor on q.k before the softmax; None, ``head_dim ** -0.5``. Passed by
        keyword, and only when it differs (Granite's ``attention_multiplier``, Gemma's
        ``query_pre_attn_scalar``), with the same loud failure for an implementation that
        lacks it (core/layers/attention.py).
        """
        ...


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionImpl
    metadata: Any
    # The step's LoRA adapters (cadence.lora.runtime.LoRAStep), None when no row has one.
    lora: Any = None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn: AttentionImpl, metadata: Any, lora: Any = None
                        ) -> Iterator[ForwardContext]:
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context does not nest: a forward pass is already running")
    _forward_context = ForwardContext(attn, metadata, lora)
    try:
        yield _forward_context
    finally:
        _forward_context = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _forward_context


def current_lora() -> Any:
    """The running step's LoRA adapters, or None (also outside a forward pass)."""
    ctx = _forward_context
    return None if ctx is None else ctx.lora
