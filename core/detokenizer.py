"""Incremental detokenization and stop-string matching. No torch here.

Uses ``tokenizers.decoders.DecodeStream`` when the tokenizer is a fast one (measured here:
0.23 ms per step for 64 sequences, the cheapest option) and otherwise the prefix/read
offset method of vLLM and TGI. Both hold back bytes of an incomplete UTF-8 character, so a
multi-byte character split over tokens appears whole, once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text, one token at a time.

    ``spaces_between_special_tokens=False`` (vLLM's option; it matters only with
    ``skip_special_tokens=False``) writes an added token that follows another added token
    as its bare content, without the space a decoder may put before it.
    """

    __slots__ = (
        "_added",
        "_backend",
        "_ids",
        "_last_added",
        "_prefix_offset",
        "_read_offset",
        "_skip",
        "_spaces",
        "_stream",
        "_tok",
    )

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._stream = None
        # Added tokens by id, kept only where their spacing is to be taken out.
        self._added: dict[int, str] | None = None
        self._last_added = False
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None:
            self._backend = backend
            self._stream = self._new_stream(prompt_token_ids)
            if not (skip_special_tokens or spaces_between_special_tokens):
                self._added = _added_tokens(backend)
        else:
            self._ids = list(prompt_token_ids)
            self._read_offset = len(self._ids)
            self._prefix_offset = max(self._read_offset - 6, 0)

    def _new_stream(self, context: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=self._skip)
        # Primed with the context's tail, so the next token decodes with the right
        # leading-space handling, as a continuation of it.
        for t in context[-6:]:
            stream.step(self._backend, t)
        return stream

    def step(self, token_id: int) -> str:
        """Return the new text that ``token_id`` completes (may be empty)."""
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id) or ""
            except Exception:  # noqa: BLE001 - any tokenizers error
                text = self._recover(token_id)
            if self._added is not None:
                content = self._added.get(token_id)
                if content is not None and self._last_added:
                    text = content
                self._last_added = content is not None
            return text
        self._ids.append(token_id)
        kw = {} if self._spaces else {"spaces_between_special_tokens": False}
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset],
                                  skip_special_tokens=self._skip, **kw)
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip,
                                **kw)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def _recover(self, token_id: int) -> str:
        # The stream's state may be broken (tokenizers refuses a decoded text that no longer
        # extends the last one, "invalid prefix"): a fresh stream takes the token alone, as
        # vLLM recovers; the text held back for an unfinished character is lost with the
        # old stream.
        self._stream = self._new_stream([])
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception:  # noqa: BLE001 - any tokenizers error
            # An id the tokenizer does not know (a model with a padded vocabulary) decodes
            # to nothing.
            self._stream = self._new_stream([])
            return ""


def _added_tokens(backend: Any) -> dict[int, str]:
    return {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()}


def token_text_decoder(tokenizer: Any) -> Callable[[int], str]:
    """``id -> tokenizer.decode([id])``, through the Rust tokenizer where that gives the same
    text: the Python wrapper around it costs ~15 us a call (argument conversion, clean-up
    checks), 6x the decode itself, and logprobs ask for k + 1 texts per token. Only a plain
    transformers fast tokenizer qualifies: one that cleans up spaces after decoding, or
    whose class rewrites the text in its own ``decode``/``_decode`` (Whisper drops timestamp
    tokens, CPM maps a placeholder to a space), keeps the wrapper."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or \
            getattr(tokenizer, "clean_up_tokenization_spaces", True) or \
            not _plain_fast_decode(type(tokenizer)):
        def decode(token: int) -> str:
            return tokenizer.decode([token])
    else:
        fast = backend.decode

        def decode(token: int) -> str:
            return fast([token], skip_special_tokens=False)
    marker = _space_marker(backend)
    if marker is None:
        return decode

    def with_its_space(token: int) -> str:
        # SentencePiece's decoder drops the space a word's first piece stands for ("▁Green"
        # decodes to "Green"), as it drops a text's first space; a token alone keeps it,
        # as vLLM shows it, so the tokens of a text join up to it.
        text = decode(token)
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return text
        missing = (len(piece) - len(piece.lstrip(marker))) - \
            (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    return with_its_space


def _space_marker(backend: Any) -> str | None:
    """The character a Metaspace (SentencePiece) pre-tokenizer writes for a space, or None
    for tokenizers whose single-token decode keeps its spaces (byte-level, WordPiece)."""
    if backend is None or not hasattr(backend, "to_str"):
        return None
    import json

    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, TypeError):
        return None
    for sub in [pre, *pre.get("pretokenizers", ())]:
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return sub.get("replacement", "\u2581")
    return None


def complete_partial_token(tokenizer: Any, token: int, context: list[int]) -> str:
    """The text of a token that holds part of a UTF-8 character (it decodes to one ending
    in "\ufffd"), read with the tokens before it: the character it completes, with what
    those tokens began of it; "" where it completes none yet (vLLM's logprob text). At most
    four tokens back, the longest a UTF-8 character spans."""
    for n in range(1, min(len(context), 4) + 1):
        before = context[-n:]
        whole = tokenizer.decode(before + [token])
        if whole.endswith("\ufffd"):
            continue
        # The tokens before that were themselves partial gave no text of their own; what
        # they began belongs to this one.
        clean = n
        while clean > 0 and tokenizer.decode([before[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        head = tokenizer.decode(before[:clean]) if clean else ""
        if whole.startswith(head):
            return whole[len(head):]
        shared = 0
        for a, b in zip(head, whole):
            if a != b:
                break
            shared += 1
        return whole[shared:]
    return ""


def token_bytes_decoder(tokenizer: Any) -> Callable[[int, str], bytes]:
    """``(id, its decoded text) -> the token's own bytes``, for OpenAI's logprob ``bytes``:
    a token holding part of a UTF-8 character decodes to "\ufffd", whose bytes are not the
    token's, and a client joins the tokens' bytes to rebuild the text. Read from the token's
    vocabulary entry where it spells its bytes: byte-level BPE's printable stand-ins (GPT-2,
    Llama 3, Qwen, SmolLM) and SentencePiece's byte fallback (``<0xE2>``); any other token's
    bytes are its text's."""
    decoder = getattr(getattr(tokenizer, "_tokenizer", None), "decoder", None)
    byte_level = "ByteLevel" in repr(decoder)
    table = {c: b for b, c in _byte_level_alphabet().items()} if byte_level else {}
    known: dict[int, bytes | None] = {}

    def own(token: int) -> bytes | None:
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str) or not piece:
            return None
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        if table and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return None

    def token_bytes(token: int, text: str) -> bytes:
        if token not in known:
            known[token] = own(token)
        raw = known[token]
        return raw if raw is not None else text.encode("utf-8")

    return token_bytes


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters, which byte-level BPE
    vocabularies are written in: printable Latin-1 bytes stand for themselves, the rest
    for the characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _plain_fast_decode(cls: type) -> bool:
    try:
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return False
    return (issubclass(cls, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """Find the stop string that the last ``new_len`` characters complete first.

    Returns ``(stop, index where it starts)``: of several, the one that ends earliest in the
    text (ties: the first in ``stops``), as vLLM picks it, so that text arriving several
    tokens at once (speculative decoding) ends where it would one token at a time. Only the
    tail that can contain a new match is searched, so the cost per token does not grow with
    the output.
    """
    best: tuple[str, int] | None = None
    best_end = len(text) + 1
    for stop in stops:
        start = max(len(text) - new_len - len(stop) + 1, 0)
        i = text.find(stop, start)
        if i != -1 and i + len(stop) < best_end:
            best, best_end = (stop, i), i + len(stop)
    return best
