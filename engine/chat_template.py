"""``render_chat``: a conversation through the tokenizer's chat template, the one place that
does it (the server's chat route and ``/tokenize``, ``LLM.chat``, ``kvserve generate --chat``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def render_chat(tokenizer: Any, conversation: list[dict[str, str]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                check_text: Callable[[str], None] | None = None,
                expand: Callable[[str], str] | None = None) -> tuple[str, list[int]]:
    """The prompt text and token ids for a conversation; ValueError when the template refuses.

    The template already holds the special tokens, so encoding adds none of its own.
    ``check_text``, when given, sees the rendered text before it is tokenised (whatever it
    raises propagates: the server refuses a text too long to tokenise there). ``expand``, when
    given, rewrites the rendered text first (an image marker into the model's image sequence).
    """
    try:
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # jinja2 TemplateError, ValueError, ...
        raise ValueError(f"the chat template could not render these messages: {exc}") from None
    if expand is not None:
        text = expand(text)
    if check_text is not None:
        check_text(text)
    return text, list(tokenizer.encode(text, add_special_tokens=False))
