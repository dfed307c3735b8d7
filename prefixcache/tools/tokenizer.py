"""The tokenizer ``prefixcache convert --tokenizer`` names: a Hugging Face model or a callable.

``--tokenizer NAME`` loads ``transformers.AutoTokenizer.from_pretrained(NAME)``
(a hub name or a local folder) and tokenizes a chat's messages the way a
serving engine does, with the model's chat template and the generation prompt
(``apply_chat_template(messages, add_generation_prompt=True)``). A tokenizer
without a chat template encodes ``"role: content"`` lines instead.

``--tokenizer module:function`` imports ``function`` from ``module`` and calls
it with the messages; it returns the prompt's token IDs. That serves a
tokenizer of one's own, and tests, which have no network to fetch a model.
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixcache.errors import InvalidArgumentError
from prefixcache.tools.convert import ChatTokenizer

__all__ = ["load_tokenizer", "messages_text"]


def load_tokenizer(spec: str) -> ChatTokenizer:
    """The chat tokenizer ``spec`` names (see the module docstring).

    Raises:
        InvalidArgumentError: ``module:function`` that cannot be imported or is not
            callable; a model name without ``transformers`` installed (the message says
            ``pip install transformers``), or one ``transformers`` cannot load.

    Complexity: that of importing or loading the tokenizer.
    """
    module_name, colon, attribute = spec.partition(":")
    if colon:
        return _import_callable(module_name, attribute)
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise InvalidArgumentError(
            f"tokenizing with {spec!r} needs Hugging Face transformers: pip install transformers "
            "(or give --tokenizer module:function, a callable of your own)"
        ) from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # OSError for a missing model, ValueError for a bad config
        raise InvalidArgumentError(f"cannot load tokenizer {spec!r}: {exc}") from exc
    return _HuggingFaceChat(tokenizer)


def _import_callable(module_name: str, attribute: str) -> ChatTokenizer:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"cannot import tokenizer module {module_name!r}: {exc}"
        ) from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise InvalidArgumentError(f"{module_name}:{attribute} is not a callable")
    return function


class _HuggingFaceChat:
    """Messages -> token IDs through a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
            return list(ids)
        return list(self.tokenizer.encode(messages_text(messages)))


def messages_text(messages: list[dict[str, Any]]) -> str:
    """``"role: content"`` a line, a multi-part content's text parts joined: the prompt text
    for a tokenizer without a chat template.

    >>> messages_text([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    'user: hi\\n'
    """
    lines = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        lines.append(f"{message['role']}: {content}\n")
    return "".join(lines)
