"""``speculative_config``: vLLM's names (``method``, ``num_speculative_tokens``,
``prompt_lookup_max``, ``prompt_lookup_min``). No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method``: where drafts come from; ``"ngram"`` (prompt lookup) finds the longest
    n-gram, ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, that ends the
    request's tokens and occurred before, and proposes the tokens that followed its latest
    earlier occurrence. ``num_speculative_tokens``: the most drafts per request per step.

    ``prompt_lookup_min`` defaults to 2: one-token matches are mostly chance where the output
    does not copy its context, and their drafts cost rows (docs/performance.md, "Speculative
    decoding")."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must not exceed prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict, a JSON object string (``--speculative-config``), a config,
        or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f'\'{{"method": "ngram", "num_speculative_tokens": 3}}\': '
                                 f"{e}") from None
        if not isinstance(value, dict):
            # ValueError, as for every other bad engine argument (TRY004 would say TypeError).
            raise ValueError(  # noqa: TRY004
                f"speculative_config must be a dict with keys {_FIELDS}, got "
                f"{type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; valid keys: "
                             f"{', '.join(_FIELDS)}")
        return cls(**value)
