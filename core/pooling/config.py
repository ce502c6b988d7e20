"""How a model pools its hidden states into an embedding: the model folder's
sentence-transformers files say it, ``--pooling-type`` / ``--pooling-normalize`` override.

Decision (docs/semantics.md, "Embeddings"): without those files, a decoder model pools its
last token and normalizes, vLLM's default for a causal LM served as an embedding model (the
last position is the only one that has read the whole prompt).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' 1_Pooling/config.json flag -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """``pooling_type``: "last" (the last prompt token's final hidden state), "mean" (the
    mean over every prompt token) or "cls" (the first token's). ``normalize``: scale to
    unit L2 norm. ``matryoshka_dimensions``: the truncations the model was trained for; an
    empty tuple when it accepts any, None when it accepts none."""

    pooling_type: str = "last"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None
    # sentence-transformers modules after the pooling that cadence does not apply (a Dense
    # projection, say): embedding requests are refused, naming them, since the vectors
    # would not be the model's. Generation is unaffected.
    unsupported_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")

    @property
    def needs_every_row(self) -> bool:
        """Whether pooling reads rows a prefix-cache hit would skip (all but the last)."""
        return self.pooling_type != "last"


def load_pooler_config(model: str, pooling_type: str | None = None,
                       normalize: bool | None = None) -> PoolerConfig:
    """The pooler of the model folder ``model``; the two arguments, when not None, win."""
    st_type, st_norm = _sentence_transformers(model, read_type=pooling_type is None)
    return PoolerConfig(pooling_type or st_type or "last",
                        normalize if normalize is not None else
                        (st_norm if st_norm is not None else True),
                        _matryoshka(model), _unsupported_modules(model))


def _read_json(path: str) -> object:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e}); pass --pooling-type and "
                         "--pooling-normalize to say how the model pools") from None


def _sentence_transformers(model: str, read_type: bool = True
                           ) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from ``modules.json`` and its Pooling module's config;
    (None, None) where the folder has no such files. ``read_type=False``: the type is
    given, so a Pooling config cadence could not follow does not matter."""
    modules_path = os.path.join(model, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} must hold a list of modules")  # noqa: TRY004
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
             if isinstance(m, dict)}
    normalize = "Normalize" in kinds
    pool = kinds.get("Pooling")
    if pool is None or not read_type:
        return None, normalize
    cfg_path = os.path.join(model, str(pool.get("path", "")), "config.json")
    if not os.path.isfile(cfg_path):
        return None, normalize
    cfg = _read_json(cfg_path)
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True] \
        if isinstance(cfg, dict) else []
    unknown = [k for k in on if k not in _ST_MODES]
    if unknown:
        raise ValueError(f"{cfg_path} asks for pooling {unknown}, which cadence does not do; "
                         f"pass --pooling-type with one of {POOLING_TYPES}")
    modes = [_ST_MODES[k] for k in on]
    if len(modes) > 1:
        raise ValueError(f"{cfg_path} turns on several pooling modes {on}; cadence pools "
                         f"one way: pass --pooling-type with one of {POOLING_TYPES}")
    return (modes[0] if modes else None), normalize


def _matryoshka(model: str) -> tuple[int, ...] | None:
    path = os.path.join(model, "config.json")
    cfg = _read_json(path) if os.path.isfile(path) else {}
    if not isinstance(cfg, dict):
        return None
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        return tuple(dims)
    return () if cfg.get("is_matryoshka") else None


# The sentence-transformers modules cadence's pooling covers.
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def _unsupported_modules(model: str) -> tuple[str, ...]:
    path = os.path.join(model, "modules.json")
    if not os.path.isfile(path):
        return ()
    modules = _read_json(path)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules
             if isinstance(m, dict)] if isinstance(modules, list) else []
    return tuple(k for k in kinds if k not in _KNOWN_MODULES)
