"""Conversations as vLLM's `LLM.chat` and the chat completions API take them: messages whose
content is a string or OpenAI's text parts, rendered by a chat template with vLLM's options."""

from __future__ import annotations

import inspect
import os
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from bcg.config import require, require_field
from bcg.utils import invalid_unicode

TEXT_PART = "{'type': 'text', 'text': ...}"
# Names chat_template_kwargs may not set: the arguments of apply_chat_template (some of them
# ChatOptions' own fields, which say so) and the variable the messages fill.
RESERVED_TEMPLATE_NAMES = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"} | {"messages"}


def read_chat_template(value: str) -> str:
    """A chat template as vLLM's --chat-template takes one: the text of the file `value`
    names, else `value` itself where it looks like a template (braces or a line break)."""
    if os.path.isfile(value):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"chat_template {value!r} cannot be read: {error}") from None
        require(text.strip() != "", f"chat_template {value!r} is an empty file: give a "
                "template")
        return text
    require(any(mark in value for mark in "{}\n"), f"chat_template {value!r} is neither a "
            "file nor a Jinja template: give a template file's path or the template itself")
    return value


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's names and defaults)."""

    chat_template: str | None = None  # a Jinja template instead of the tokenizer's own
    add_generation_prompt: bool = True  # end ready for the assistant's reply
    continue_final_message: bool = False  # leave the last message open: the reply goes on
    add_special_tokens: bool = False  # the tokenizer's own (BOS) on top of the template's
    chat_template_kwargs: Mapping[str, Any] | None = None  # more template variables

    def __post_init__(self) -> None:
        require_field("chat_template",
                      self.chat_template is None or isinstance(self.chat_template, str),
                      f"chat_template must be a Jinja template (a string), got "
                      f"{type(self.chat_template).__name__}")
        for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            require_field(name, isinstance(getattr(self, name), bool),
                          f"{name} must be true or false, got {getattr(self, name)!r}")
        require_field("continue_final_message",
                      not (self.add_generation_prompt and self.continue_final_message),
                      "add_generation_prompt and continue_final_message cannot both be true: "
                      "continuing the last message leaves no room for a new reply's prompt")
        self._check_template_kwargs()

    def _check_template_kwargs(self) -> None:
        kwargs = self.chat_template_kwargs
        require_field("chat_template_kwargs", kwargs is None or (
            isinstance(kwargs, Mapping) and all(isinstance(key, str) for key in kwargs)),
            f"chat_template_kwargs must map variable names to values, got {kwargs!r}")
        reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs or {}))
        require_field("chat_template_kwargs", not reserved,
                      f"chat_template_kwargs may not set {', '.join(reserved)}: they are not "
                      "template variables (pass chat_template, add_generation_prompt and "
                      "continue_final_message as their own arguments)")

    def template_arguments(self) -> dict[str, Any]:
        """`apply_chat_template`'s keyword arguments: the template's variables and these
        options, rendered to text."""
        return {**(self.chat_template_kwargs or {}), "chat_template": self.chat_template,
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "tokenize": False}


DEFAULT_CHAT = ChatOptions()


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each message as chat templates take it: content a string (text parts joined by
    newlines, as vLLM joins them; an assistant's missing content empty)."""
    require(isinstance(messages, Sequence) and not isinstance(messages, str) and messages,
            "a conversation must be a non-empty list of {'role': ..., 'content': ...} "
            "messages")
    return [_template_message(index, message) for index, message in enumerate(messages)]


def _template_message(index: int, message: Any) -> dict[str, Any]:
    if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)):
        raise ValueError(f"message {index}: a message is a dict with a 'role' string and "
                         f"'content', got {reprlib.repr(message)}")
    content = message.get("content")
    require(content is not None or message["role"] == "assistant",
            f"message {index}: a {message['role']} message needs content (a string or text "
            "parts)")
    return {**message, "content": _content_text(index, content)}


def _content_text(index: int, content: Any) -> str:
    text = _joined_parts(index, content)
    invalid = invalid_unicode(text)
    require(invalid is None, f"message {index}: its content {invalid}: pass UTF-8 text")
    return text


def _joined_parts(index: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    problem = content_problem(content)
    require(problem is None, f"message {index}: content {problem}")
    return "\n".join(part["text"] for part in content)


def content_problem(content: Any) -> str | None:
    """What keeps a message's content (not None) from being text, said of the content
    ("content " + it reads as a sentence), or None: a string, or a list of text parts."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return _not_text(type(content).__name__)
    others = sorted({type(part).__name__ for part in content if not isinstance(part, Mapping)})
    if others:
        return _not_text(f"a list holding {', '.join(others)}")
    kinds = sorted({str(part.get("type")) for part in content} - {"text"})
    if kinds:
        return (f"parts of type {', '.join(kinds)} are not supported: only text parts "
                f"({TEXT_PART})")
    if not all(isinstance(part.get("text"), str) for part in content):
        return f"parts must each have a string 'text' ({TEXT_PART})"
    return None


def _not_text(got: str) -> str:
    return f"must be a string or a list of text parts ({TEXT_PART}), got {got}"
