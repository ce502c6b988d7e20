"""Reasoning parsers: the thinking of a reasoning model (``<think> ... </think>``) returned
apart from its answer, as ``reasoning_content`` beside ``content`` on
/v1/chat/completions (``engine serve --reasoning-parser NAME``, vLLM's flag and field).
No torch here.

- ``deepseek_r1``: the reply is thinking up to ``</think>`` (DeepSeek-R1's template opens
  the ``<think>`` in the prompt, so the reply may not repeat it); a reply that never closes
  it is all thinking.
- ``qwen3``: thinking only where the reply opens with ``<think>`` (Qwen3 with
  ``enable_thinking`` off writes none); the rest is the answer.

The answer is what the tool parsers and the structured-output constraints see; a
constraint applies to the whole reply, so a constrained request gets no room to think.
"""

from __future__ import annotations

from typing import ClassVar

from cadence.server.tool_parsers import marker_tail


class ReasoningParser:
    """Splits a reply into its thinking and its answer (either may be None)."""

    name: ClassVar[str] = ""
    START: ClassVar[str] = "<think>"
    END: ClassVar[str] = "</think>"
    #: Whether the reply thinks even where it does not open with ``START``.
    thinks_first: ClassVar[bool] = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        opened = body.startswith(self.START)
        if not opened and not self.thinks_first:
            return None, text
        if opened:
            body = body[len(self.START):]
        at = body.find(self.END)
        if at < 0:
            return body or None, None
        return body[:at] or None, body[at + len(self.END):] or None

    def sure(self, text: str, final: bool) -> tuple[int, int, int, int]:
        """Where the thinking and the answer lie in ``text`` so far, as far as is sure:
        (thinking start, thinking end, answer start, answer end); a part not begun is an
        empty range. ``final``: the reply is complete, nothing is held back."""
        n = len(text)
        body_at = n - len(text.lstrip())
        body = text[body_at:]
        if not final and self.START.startswith(body) and body != self.START:
            return 0, 0, n, n  # may still open with the marker
        opened = body.startswith(self.START)
        if not opened and not self.thinks_first:
            return 0, 0, 0, n
        start = body_at + (len(self.START) if opened else 0)
        end = text.find(self.END, start)
        if end < 0:
            keep = 0 if final else marker_tail(text, self.END)
            return start, n - keep, n, n
        return start, end, end + len(self.END), n


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_first = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


class ReasoningStream:
    """A streamed reply's thinking and answer: each sent once it is sure which it is."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text: dict[int, str] = {}
        self._sent: dict[int, tuple[int, int]] = {}  # thinking, answer characters sent

    def delta(self, index: int, new: str, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) to send now for sample ``index``, given its newest text."""
        text = self._text[index] = self._text.get(index, "") + new
        r0, r1, a0, a1 = self.parser.sure(text, final)
        sent_r, sent_a = self._sent.get(index, (0, 0))
        thinking = text[r0 + sent_r:r1] if r1 - r0 > sent_r else ""
        answer = text[a0 + sent_a:a1] if a1 - a0 > sent_a else ""
        self._sent[index] = (max(sent_r, r1 - r0), max(sent_a, a1 - a0))
        return thinking, answer


