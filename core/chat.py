"""Chat prompts: one rendering for ``LLM.chat``, ``engine generate --chat`` and
``/v1/chat/completions`` (docs/semantics.md).

NOTE: a chat template writes the special tokens it wants (``{{ bos_token }}`` and the
like) into its text, so the rendered text is tokenized with ``add_special_tokens=False``.
Encoding it as a plain prompt would put a second BOS in front of the template's, which
degrades many models' answers. The token ids equal transformers'
``apply_chat_template(messages, tokenize=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cadence.sampling_params import is_valid_unicode

Conversation = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation: the template's text and its token ids."""

    text: str
    token_ids: list[int]

    def as_engine_prompt(self) -> dict:
        """The prompt dict ``LLMEngine.add_request`` takes (its ids are used as they are)."""
        return {"prompt": self.text, "prompt_token_ids": list(self.token_ids)}


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template of its own."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Conversation, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None,
                add_special_tokens: bool = False) -> ChatPrompt:
    """Render one conversation with the tokenizer's template (or ``chat_template``) and
    tokenize it without adding special tokens again (the template placed them;
    ``add_special_tokens=True`` adds the tokenizer's anyway, vLLM's option); ``tools``
    (OpenAI's function definitions) and ``documents`` reach the template as transformers
    passes them. Raises ValueError naming ``messages`` or ``chat_template`` when either is
    unusable."""
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("chat_template: this model's tokenizer has no chat template; pass "
                         "one as chat_template, or send plain prompts instead")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise ValueError(f"chat_template must be a non-empty Jinja template string or None, "
                         f"got {chat_template!r:.60}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True continues the last message, so it "
                         "needs add_generation_prompt=False (which opens a new one)")
    conversation = [_message(m, i) for i, m in enumerate(_checked(messages))]
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({"tools": list(tools)} if tools else {}),
            **({"documents": list(documents)} if documents else {}),
            **dict(chat_template_kwargs or {}))
    # The template is the model author's (or the caller's) code: jinja's TemplateError for
    # roles out of order, but a template may raise anything, and it is the input's fault.
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ == "TemplateSyntaxError":  # jinja's: the template, not the input
            raise ValueError(f"chat_template does not parse as a Jinja template: {e}") \
                from None
        raise ValueError(f"messages: the chat template rejected them: {e}") from None
    if not isinstance(text, str) or not text:
        raise ValueError("messages: the chat template rendered them as an empty prompt")
    if not is_valid_unicode(text):
        raise ValueError("messages must be valid Unicode text (they hold a lone surrogate)")
    return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))


def split_conversations(messages: Any) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them, as a list of
    conversations (vLLM's ``LLM.chat`` accepts both)."""
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages \
            and all(isinstance(c, Sequence) and not isinstance(c, (str, bytes))
                    for c in messages):
        return list(messages)
    return [messages]


def _checked(messages: Any) -> Conversation:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) \
            or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                         f"dicts (or a list of such lists), got {messages!r:.60}")
    return messages


def _message(message: Any, index: int) -> dict[str, Any]:
    """A message as the template expects it: text parts joined into one string."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(  # noqa: TRY004 (a user mistake is a ValueError: STYLE.md)
            f"messages[{index}] must be a dict with a string 'role' and a 'content', got "
            f"{message!r:.60}")
    content = message.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str):
        parts = [p.get("text") if isinstance(p, Mapping) and p.get("type") == "text" else None
                 for p in content]
        if any(not isinstance(p, str) for p in parts):
            raise ValueError(f"messages[{index}].content must be a string or a list of "
                             "{'type': 'text', 'text': ...} parts")
        content = "\n".join(parts)  # vLLM's join for templates that take a string
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string, a list of text parts "
                         f"or None, got {type(content).__name__}")
    return {**message, "content": content or ""}
