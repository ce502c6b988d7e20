"""What a body's validation errors say, in the body's own terms: the field (as a dotted
path, ``messages.0.content.0.text``) and what is wrong with it.

Pydantic reports a field with a union type (``prompt``, a message's ``content``, an item
of the Responses ``input``) once per branch, each error's location tagged with the branch:
a shape (``str``, ``list[int]``) or a model's class name (``MessageItem``). The first
error is the first branch's complaint, rarely the one the client needs: the branch it
meant is found from the value's own shape or its ``type``, and that branch's error named.
"""

from __future__ import annotations

import re
from typing import Any

_PRIMITIVES = frozenset({"str", "int", "float", "bool", "dict"})
# Body fields whose values are JSON objects with keys of the client's choosing.
MAPPING_FIELDS = frozenset({"logit_bias"})


class ErrorNamer:
    """Names validation errors of one body model (None: a route without one)."""

    def __init__(self, body: type | None) -> None:
        self.body = body
        self.models = _models(body)

    def name(self, errors: list[dict]) -> tuple[str, str]:
        """(field, message) for the errors of a body that reached its fields."""
        err = errors[0]
        loc = _loc(err)
        key = ""
        if loc[0] in MAPPING_FIELDS:
            # Inside a mapping the next location is a key the client chose ("logit_bias.5",
            # or one that reads like a union tag): name the field, and the key beside it.
            key = f" (key {loc[1]!r})" if len(loc) > 1 else ""
            loc = loc[:1]
        elif self._tags(err, loc):
            return self._union(errors)
        if err.get("type") == "extra_forbidden":
            return self._unknown(loc)
        field = ".".join(loc)
        if err.get("type") == "missing":
            return field, f"{field} is required"
        return field, f"{field}{key}: {err.get('msg')}"

    def _tags(self, err: dict, loc: list[str]) -> list[int]:
        """The positions of branch tags in ``loc`` (an unknown field's own name is never
        one, whatever it is called)."""
        last = len(loc) - 1 if err.get("type") == "extra_forbidden" else len(loc)
        return [i for i, x in enumerate(loc[:last]) if self._is_tag(x)]

    def _is_tag(self, segment: str) -> bool:
        return "[" in segment or segment in _PRIMITIVES or segment in self.models

    def _plain(self, loc: list[str]) -> list[str]:
        return [x for x in loc if not self._is_tag(x)]

    def _union(self, errors: list[dict]) -> tuple[str, str]:
        """A branch is ruled out where its shape does not match (an error at the branch's
        tag: a list given for a string) or where it is a model whose ``type`` is another
        literal than the one sent (or none was sent). What is left is the branch the
        client meant, and its first error is the one to name. With nothing left, the
        deepest union is named with the shapes it takes, or the ``type`` values it knows."""
        locs = [_loc(e) for e in errors]
        out: set[tuple[str, ...]] = set()
        for e, loc in zip(errors, locs):
            if self._is_tag(loc[-1]):
                out.add(tuple(loc))  # shape mismatch: the value is not of this branch's type
            elif self._kind_mismatch(e, loc):
                out.add(tuple(loc[:-1]))  # a model of another kind
        # The branches whose shape the value had (it failed inside them, not at their tag),
        # by the union's location.
        inside: dict[tuple[str, ...], set[str]] = {}
        for loc in locs:
            for i, x in enumerate(loc[:-1]):
                if self._is_tag(x):
                    inside.setdefault(tuple(loc[:i]), set()).add(x)
        for e, loc in zip(errors, locs):
            tags = self._tags(e, loc)
            # A branch was meant where it is a model whose type matched, or the one shape
            # the value had; a list of numbers that fails as list[str] at index 0 and as
            # list[int] at 1 meant neither.
            if any(loc[i] not in self.models and inside.get(tuple(loc[:i])) != {loc[i]}
                   for i in tags):
                continue
            if not any(tuple(loc[:i + 1]) in out for i in tags):
                return self._one(e, loc)
        return self._no_branch(errors, locs)

    def _kind_mismatch(self, err: dict, loc: list[str]) -> bool:
        return len(loc) > 1 and loc[-1] == "type" and loc[-2] in self.models and \
            err.get("type") in ("literal_error", "missing")

    def _one(self, err: dict, loc: list[str]) -> tuple[str, str]:
        """The message for one error inside the branch the client meant."""
        if err.get("type") == "extra_forbidden":
            return self._unknown(loc)
        field = ".".join(self._plain(loc))
        if err.get("type") == "missing":
            return field, f"{field} is required"
        return field, f"{field}: {err.get('msg')}"

    def _no_branch(self, errors: list[dict], locs: list[list[str]]) -> tuple[str, str]:
        shape_at = max((loc[:-1] for loc in locs if self._is_tag(loc[-1])), key=len,
                       default=[])
        kinds_at = [loc[:-2] for e, loc in zip(errors, locs) if self._kind_mismatch(e, loc)]
        if kinds_at and len(max(kinds_at, key=len)) >= len(shape_at):
            where = max(kinds_at, key=len)
            kinds: list[str] = []
            for loc in locs:
                if loc[:-2] == where and loc[-1] == "type" and loc[-2] in self.models:
                    for kind in _literals(self.models[loc[-2]], "type"):
                        if kind not in kinds:
                            kinds.append(kind)
            field = ".".join([*self._plain(where), "type"])
            return field, f"{field} must be one of: {', '.join(kinds)}"
        field = ".".join(self._plain(shape_at))
        n, shapes = len(shape_at), []
        for loc in locs:
            if loc[:n] == shape_at and len(loc) > n and self._is_tag(loc[n]) and \
                    loc[n] not in shapes:
                shapes.append(loc[n])
        return field, f"{field} has the wrong type or value; it must be one of: " + \
            ", ".join(_UNION.sub(lambda m: m.group(1).replace(",", " | "), shape)
                      for shape in shapes)

    def _unknown(self, loc: list[str]) -> tuple[str, str]:
        """An unknown field (its name kept, whatever it is), with the valid ones of the
        object it was found in."""
        field = ".".join([*self._plain(loc[:-1]), loc[-1]])
        model = self._model_at(loc[:-1])
        valid = f"; valid fields: {', '.join(sorted(model.model_fields))}" if model else ""
        return field, f"unknown field {field!r}{valid}"

    def _model_at(self, loc: list[str]) -> type | None:
        """The model of the object at ``loc``, found by walking the annotations from the
        body (list indexes and shape tags pass through; a class tag names its model)."""
        model = self.body
        for segment in loc:
            if segment in self.models:
                model = self.models[segment]
            elif segment.isdigit() or self._is_tag(segment):
                continue
            else:
                field = getattr(model, "model_fields", {}).get(segment)
                if field is None:
                    return None
                inner = [t for t in _types_in(field.annotation) if hasattr(t, "model_fields")]
                # Several models: a union, whose class tag comes next.
                model = inner[0] if len(inner) == 1 else None
        return model


def _loc(err: dict) -> list[str]:
    return [str(x) for x in err.get("loc", ()) if x != "body"]


def _models(body: type | None) -> dict[str, type]:
    """The pydantic models reachable from ``body``'s fields, by class name."""
    found: dict[str, type] = {}
    todo = [body] if body is not None else []
    while todo:
        model = todo.pop()
        for f in getattr(model, "model_fields", {}).values():
            for t in _types_in(f.annotation):
                if hasattr(t, "model_fields") and t.__name__ not in found:
                    found[t.__name__] = t
                    todo.append(t)
    return found


def _types_in(annotation: Any) -> list[Any]:
    """The types (and Literal values) an annotation is built from."""
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types_in(a)]


def _literals(model: type, field: str) -> list[str]:
    """The string values a model's Literal field takes, quoted as pydantic quotes them."""
    info = model.model_fields.get(field)
    if info is None:
        return []
    return [repr(v) for v in _types_in(info.annotation) if isinstance(v, str)]


# pydantic's tag of a union inside a shape, "list[union[A,B]]", read as "list[A | B]".
_UNION = re.compile(r"union\[([^\[\]]*)\]")
