"""What a chat reply's text becomes in the response: the thinking of a reasoning model
(``reasoning_content``), the answer (``content``) and the tool calls read from it, for a
whole reply and for a stream's deltas (core/server/reasoning.py, core/server/tools.py).
No torch here."""

from __future__ import annotations

from typing import Any

from cadence.server import reasoning, tools


class ChatReply:
    """One chat request's reply shaping: its tool choice, the server's tool parser and
    reasoning parser (either may be None), and whether it may make several calls
    (``parallel_tool_calls``)."""

    def __init__(self, choice: str | tools.NamedToolChoice,
                 tool_parser: tools.ToolParser | None,
                 reasoning_parser: reasoning.ReasoningParser | None,
                 parallel: bool = True) -> None:
        self.choice, self.tool_parser, self.reasoning_parser = choice, tool_parser, \
            reasoning_parser
        self.parallel = parallel
        self._calls = None if choice == "none" else \
            tools.ToolStream(choice, tool_parser, parallel)
        self._thinks = None if reasoning_parser is None else \
            reasoning.ReasoningStream(reasoning_parser)

    def whole(self, text: str, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """The message fields of a finished reply (``content`` and, where they apply,
        ``reasoning_content`` and ``tool_calls``) and its finish reason."""
        fields: dict[str, Any] = {"content": text}
        answer: str | None = text
        if self.reasoning_parser is not None:
            fields["reasoning_content"], answer = self.reasoning_parser.split(text)
            fields["content"] = answer
        if self.choice == "none":
            return fields, finish_reason
        if answer is None:  # all thinking: no answer to read calls from
            return fields, tools.finish_reason_of(self.choice, [], finish_reason)
        fields["content"], calls = tools.reply_of(self.choice, self.tool_parser, answer,
                                                  self.parallel)
        if calls:
            fields["tool_calls"] = [call.as_json() for call in calls]
        return fields, tools.finish_reason_of(self.choice, calls, finish_reason)

    def delta(self, index: int, new: str, finished: bool) -> dict[str, Any] | None:
        """What a stream sends now for sample ``index``, given its newest text; None:
        nothing yet (held back: a marker's characters, a possible tool call)."""
        thinking, answer = ("", new) if self._thinks is None else \
            self._thinks.delta(index, new, finished)
        if self._calls is None:
            delta = {"content": answer} if answer else None
        else:
            delta = self._calls.delta(index, answer)
        if thinking:
            delta = {"reasoning_content": thinking, **(delta or {})}
        return delta

    def finish(self, index: int, finish_reason: str | None
               ) -> tuple[dict[str, Any] | None, str | None]:
        """The last delta of a finished sample (content held back, calls not sent yet) and
        its finish reason."""
        if self._calls is None:
            return None, finish_reason
        return self._calls.finish(index, finish_reason)
