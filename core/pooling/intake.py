"""Admission of embedding requests: the checks that name the problem, and the one-token
greedy request an embedding request runs as. No torch here."""

from __future__ import annotations

import json
import os

from cadence.config import EngineConfig
from cadence.pooling.params import PoolingParams
from cadence.pooling.state import PoolingState
from cadence.sampling_params import FieldError, SamplingParams


class PoolingIntake:
    """What the engine needs to admit embedding requests for one model and backend."""

    def __init__(self, config: EngineConfig, backend_name: str, supported: bool) -> None:
        self.pooler = config.model_config.pooler_config
        self.max_model_len = config.scheduler_config.max_model_len
        self.backend_name = backend_name
        self.supported = supported
        self.hidden_size = embedding_size(config.model_config.model)

    @staticmethod
    def sampling_params(pp: PoolingParams) -> SamplingParams:
        """The request an embedding runs as. Its one sampled token is dropped; the step that
        completes the prompt samples it anyway, so embedding requests share every backend's
        ordinary step, and it costs one row of the LM head."""
        return SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                              truncate_prompt_tokens=pp.truncate_prompt_tokens)

    def check(self, ids: list[int], pp: PoolingParams) -> None:
        """Refuse what the engine could not embed as asked (a ``FieldError``)."""
        if not self.supported:
            raise FieldError(f"embeddings are not supported by the {self.backend_name!r} "
                             "backend", "pooling_params")
        if self.pooler.unsupported_modules:
            raise FieldError(f"embeddings of this model need its sentence-transformers "
                             f"modules {list(self.pooler.unsupported_modules)} (modules.json), "
                             "which cadence does not apply; its vectors would not be the "
                             "model's", "pooling_params")
        if len(ids) >= self.max_model_len:
            # The one internal token needs a position, as a generation's first one does.
            raise FieldError(f"prompt has {len(ids)} tokens; an embedding prompt must have "
                             f"fewer than max_model_len={self.max_model_len}", "prompt")
        d = pp.dimensions
        if d is None:
            return
        dims = self.pooler.matryoshka_dimensions
        if dims is None:
            raise FieldError("dimensions is not supported by this model: it was not trained "
                             "for Matryoshka embeddings (its config.json has neither "
                             "is_matryoshka nor matryoshka_dimensions)", "dimensions")
        if dims and d not in dims:
            raise FieldError(f"dimensions must be one of {list(dims)} for this model, got "
                             f"{d}", "dimensions")
        if self.hidden_size is not None and d > self.hidden_size:
            raise FieldError(f"dimensions must be <= the model's embedding size "
                             f"{self.hidden_size}, got {d}", "dimensions")

    def state(self, pp: PoolingParams, num_prompt_tokens: int) -> PoolingState:
        return PoolingState.create(self.pooler, pp.normalize, pp.dimensions, num_prompt_tokens)


def embedding_size(model: str) -> int | None:
    """The width of the final hidden states (config.json), None when it does not say."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None
