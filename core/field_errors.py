"""How a bad value of a request is named: ``FieldError`` (a ``ValueError`` with the field in
``param``) and the helpers that write its messages. No torch here."""

from __future__ import annotations

import re


class FieldError(ValueError):
    """A bad value of one request field: a ``ValueError`` whose ``param`` names the field as
    the Python API calls it (``top_k``, ``prompt``, ``priority``), so a server can name it in
    its error body without parsing the message."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:
        # The default rebuilds from ``args`` (the message alone) and would lose ``param``.
        return type(self), (str(self), self.param)


def token_id_key(key: str) -> int | None:
    """The token id a JSON object key spells (OpenAI's ``logit_bias`` form, "50256"), or
    None: digits only, no leading zero ("05" would collide with "5"), at most 18 of them."""
    if _TOKEN_KEY.fullmatch(key) is None:
        return None
    return int(key)


_TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def is_valid_unicode(text: str) -> bool:
    """False for strings UTF-8 cannot encode (lone surrogates, e.g. from a JSON "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters; an int too long
    for ``repr`` (over 4300 digits) is described instead of raising a ValueError that does
    not name the field."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return "<an integer with too many digits to show>"
        return f"<a {type(value).__name__} holding an integer with too many digits to show>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
