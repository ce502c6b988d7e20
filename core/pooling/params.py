"""Per-request pooling parameters, named and validated like vLLM's ``PoolingParams``."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from cadence.sampling_params import FieldError


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What one embedding request asks.

    ``dimensions=d`` keeps the first ``d`` entries of the pooled vector before it is
    normalized (Matryoshka embeddings); only models trained for it accept it (their
    ``config.json`` says ``is_matryoshka`` or lists ``matryoshka_dimensions``), as in vLLM.
    ``normalize`` overrides the model's own choice (``PoolerConfig.normalize``) for this
    request: True scales the vector to unit L2 norm, False returns it as pooled.
    ``truncate_prompt_tokens=k`` embeds the prompt's last ``k`` tokens; -1 as many as the
    context holds (``max_model_len - 1``: an embedding runs as a one-token generation).

    Every invalid value raises a ``FieldError`` (a ValueError) naming the field.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, minus_one in (("dimensions", ""),
                                ("truncate_prompt_tokens", ", -1 (the context less one token)")):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool)
                                  or not (v >= 1 or (minus_one and v == -1))):
                raise FieldError(f"{name} must be None{minus_one} or an integer >= 1, got "
                                 f"{v!r}", name)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise FieldError(f"normalize must be None, true or false, got "
                             f"{self.normalize!r}", "normalize")
