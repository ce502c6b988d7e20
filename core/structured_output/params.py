"""What a request asks its output to follow. No torch, no xgrammar here.

``StructuredOutputsParams`` mirrors vLLM's class of the same name: exactly one of ``json``
(a JSON schema, as a dict or a JSON string), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings) or ``grammar`` (xgrammar's EBNF, GBNF-like).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """The constraint on one request's output; every sample of ``n > 1`` follows it.

    ``disable_any_whitespace=True`` makes JSON compact (no whitespace between tokens of the
    JSON syntax, as vLLM writes it); by default any whitespace is allowed, as in vLLM.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of " + ", ".join(KINDS)
                + f"; got {given or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be True or False")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            elif not isinstance(value, dict):
                raise ValueError("structured_outputs.json must be a JSON schema: a dict or a "
                                 f"JSON string, got {type(value).__name__}")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be True or None")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(value)
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (the compile cache's key, with the kind)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            return json.dumps(value)  # property order is part of the schema
        if isinstance(value, list):
            return json.dumps(value)
        return str(value)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec, self.disable_any_whitespace)

    @classmethod
    def from_dict(cls, data: Any, where: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's object (vLLM's ``structured_outputs`` field)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object")
        allowed = (*KINDS, "disable_any_whitespace")
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown}; allowed: {list(allowed)}")
        return cls(**data)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of ``choices`` (JSON string escapes are
    EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
