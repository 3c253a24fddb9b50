"""The one renderer: an OpenAI request body (chat or completions) -> the text and token ids the engine runs.

The server, ``LLM.chat``, the planner and the router all render here, so a body gets the same tokens (and so the
same block hashes) wherever it is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvprefix.prompts.tokenizer import Tokenizer

# OpenAI's newer name for "system"; checkpoint templates know only the latter.
_ROLE_ALIASES = {"developer": "system"}


class PromptError(ValueError):
    """A body that cannot be rendered; ``param`` names the field (for a 400 that points at it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RenderedPrompt:
    """``text`` is None for a prompt given as token ids. ``message_spans`` has, per chat message, the
    [start, end) character span of its content in ``text`` (None where the template changed the content)."""

    token_ids: list[int]
    text: str | None
    message_spans: tuple[tuple[int, int] | None, ...] = ()


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as templates expect them: role (developer -> system) and content as one string (text parts
    joined, None -> ""). Other fields (name, refusal, annotations) carry nothing a template renders."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = message["role"]
        out.append({"role": _ROLE_ALIASES.get(role, role), "content": _content_text(message.get("content"), i)})
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise PromptError(f"messages[{index}].content: only text parts are supported, got {kind!r}",
                                  "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise PromptError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def render_chat(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> RenderedPrompt:
    """Renders with the checkpoint's chat template; the template writes any BOS itself, so none is added."""
    normalized = normalize_messages(messages)
    if not normalized:
        raise PromptError("'messages' must not be empty", "messages")
    try:
        text = tokenizer.apply_chat_template(normalized, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # a template can raise anything (jinja2 errors for unexpected roles, ValueError)
        raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
    return RenderedPrompt(tokenizer.encode(text, add_special_tokens=False), text, _message_spans(text, normalized))


def _message_spans(text: str, messages: list[dict[str, str]]) -> tuple[tuple[int, int] | None, ...]:
    """Finds each message's content in order; templates render messages in order, so a forward search suffices."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for message in messages:
        content = message["content"]
        start = text.find(content, cursor) if content else -1
        if start < 0:
            spans.append(None)
            continue
        cursor = start + len(content)
        spans.append((start, cursor))
    return tuple(spans)


def render_completion(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> RenderedPrompt:
    """A completions prompt: text is tokenized with the tokenizer's special tokens (BOS), token ids pass as is."""
    if isinstance(prompt, str):
        return RenderedPrompt(tokenizer.encode(prompt), prompt)
    return RenderedPrompt(list(prompt), None)


def render_body(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[RenderedPrompt]:
    """Every prompt of a raw JSON body: one for chat (``messages``), one per prompt for completions."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise PromptError("'messages' must be a list", "messages")
        return [render_chat(tokenizer, messages, add_generation_prompt=body.get("add_generation_prompt", True))]
    if "prompt" in body:
        return [render_completion(tokenizer, p) for p in completion_prompts(body["prompt"])]
    raise PromptError("a request body needs 'messages' (chat) or 'prompt' (completions)", "messages")


def completion_prompts(prompt: Any) -> list[str] | list[list[int]]:
    """The prompts of a completions ``prompt`` field as a batch: a string, a list of strings, a list of token ids,
    or a list of those."""
    if isinstance(prompt, str) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return list(prompt)
    raise PromptError("'prompt' must be a non-empty string, list of strings, list of token ids, or list of those",
                      "prompt")


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
