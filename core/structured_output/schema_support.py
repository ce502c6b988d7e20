"""The JSON Schema keywords xgrammar would accept and then not enforce.

xgrammar compiles a schema whatever keywords it holds, and drops the ones its converter does
not implement: a request constrained by ``uniqueItems`` could finish with ``stop`` on
``[2, 2, 2]``. cadence's promise is that a constrained output that finishes matches its
constraint, so such a schema is refused, naming the keyword and where it is, as vLLM's
xgrammar backend refuses it (vLLM can hand it to another backend; cadence has none). The
list follows xgrammar's open issues (numbers in the comments) and was checked against
xgrammar 0.2.9 by constraining a random model and validating what it wrote. No torch here.
"""

from __future__ import annotations

from typing import Any

# The string formats xgrammar's converter writes a grammar for.
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords with no grammar at all: their conditions are dropped.
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "unevaluatedItems")


def unsupported_schema_feature(schema: Any, path: str = "") -> str | None:
    """The first keyword of ``schema`` (a JSON Schema as a dict) xgrammar would not enforce,
    as "<keyword> at <path>", or None."""
    if not isinstance(schema, dict):
        return None
    found = _here(schema)
    if found is not None:
        return f"{found} at {path or 'the root'}"
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        if isinstance(value, dict):
            hit = unsupported_schema_feature(value, f"{path}.{key}".lstrip("."))
        elif isinstance(value, list):
            hit = next((h for i, item in enumerate(value) if (h := unsupported_schema_feature(
                item, f"{path}.{key}.{i}".lstrip("."))) is not None), None)
        else:
            hit = None
        if hit is not None:
            return hit
    return None


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bounded_text(schema: dict) -> bool:
    return ("pattern" in schema or "format" in schema) and \
        ("minLength" in schema or "maxLength" in schema)


def _here(schema: dict) -> str | None:
    """The unsupported keyword of this one schema object (not its children)."""
    kinds = _types(schema)
    for key in _IGNORED:
        if key in schema:
            return key
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) >= 2:
        return "allOf with several schemas"  # xgrammar #937: any JSON passes
    if "number" in kinds and "multipleOf" in schema:
        return "multipleOf on a number"  # enforced for integers only
    if "array" in kinds:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):  # #968
            if key in schema and schema[key] is not False:
                return key
    if "string" in kinds:
        if "format" in schema and schema["format"] not in SUPPORTED_FORMATS:
            return f"format {schema['format']!r}"
        if _bounded_text(schema):  # #966
            return "pattern or format together with minLength/maxLength"
    if "object" in kinds or "properties" in schema:
        names = schema.get("propertyNames")
        if names is not None:
            if isinstance(names, dict) and _bounded_text(names):  # #960
                return "propertyNames with a bounded pattern"
            for key in ("patternProperties", "properties"):  # #959, #958
                if key in schema:
                    return f"propertyNames together with {key}"
            if schema.get("unevaluatedProperties", True) is not True:  # #961
                return "propertyNames together with unevaluatedProperties"
        patterns = schema.get("patternProperties")
        if isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1):
            return "patternProperties together with properties, or more than one"  # #964/5
    return None
