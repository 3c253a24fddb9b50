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
    """A body that cannot be rendered; ``param`` names the field (for a 400 that points at it), ``code`` is an
    OpenAI error code where one applies."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


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
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
    tools: Sequence[Any] | None = None,
) -> RenderedPrompt:
    """Renders with the checkpoint's chat template; the template writes any BOS itself, so none is added.
    ``tools`` (OpenAI's list of tool definitions) goes to the template as ``tools``: a template that renders
    tools puts them in the prompt, one that does not ignores them.

    Message content is text: a special token's spelling typed into it ("<|im_start|>system") stays text, as
    llama.cpp treats user text, so no message can forge a role or end another. ``max_tokens``: refuse, before
    tokenizing, a prompt too long in characters to fit in that many tokens (tokenizing megabytes takes seconds).
    """
    normalized = normalize_messages(messages)
    if not normalized:
        raise PromptError("'messages' must not be empty", "messages")
    try:
        extra = {} if tools is None else {"tools": list(tools)}
        text = tokenizer.apply_chat_template(normalized, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **extra)
    except Exception as exc:  # a template can raise anything (jinja2 errors for unexpected roles, ValueError)
        raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
    _check_length(tokenizer, text, max_tokens, "messages")
    spans = _message_spans(text, normalized)
    specials = tokenizer.special_tokens
    if any(special in m["content"] for m in normalized for special in specials):
        token_ids = _encode_with_literal_spans(tokenizer, text, spans)
    else:  # the usual case: nothing in the content looks special, so the whole text tokenizes as one
        token_ids = tokenizer.encode(text, add_special_tokens=False)
    return RenderedPrompt(token_ids, text, spans)


def _encode_with_literal_spans(tokenizer: Tokenizer, text: str, spans) -> list[int]:
    """The template's own text with its special tokens, each message's content as plain text."""
    ids: list[int] = []
    cursor = 0
    for span in spans:
        if span is None:
            continue
        start, end = span
        ids += tokenizer.encode(text[cursor:start], add_special_tokens=False) if start > cursor else []
        ids += tokenizer.encode_literal(text[start:end])
        cursor = end
    if cursor < len(text):
        ids += tokenizer.encode(text[cursor:], add_special_tokens=False)
    return ids


def _check_length(tokenizer: Tokenizer, text: str, max_tokens: int | None, param: str) -> None:
    if max_tokens is not None and len(text) > max_tokens * tokenizer.max_chars_per_token:
        raise PromptError(
            f"this model's maximum context length is {max_tokens} tokens, but the prompt has {len(text)} "
            f"characters, more than {max_tokens} tokens can hold", param, code="context_length_exceeded")


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


def render_completion(
    tokenizer: Tokenizer, prompt: str | Sequence[int], max_tokens: int | None = None
) -> RenderedPrompt:
    """A completions prompt: text is tokenized with the tokenizer's special tokens (BOS; special tokens written
    in it are parsed, since a raw prompt is where a caller writes its own template), token ids pass as is.
    ``max_tokens`` as for ``render_chat``."""
    if isinstance(prompt, str):
        _check_length(tokenizer, prompt, max_tokens, "prompt")
        return RenderedPrompt(tokenizer.encode(prompt), prompt)
    return RenderedPrompt(list(prompt), None)


def render_body(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[RenderedPrompt]:
    """Every prompt of a raw JSON body: one for chat (``messages``), one per prompt for completions."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise PromptError("'messages' must be a list", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise PromptError("'tools' must be a list", "tools")
        return [render_chat(tokenizer, messages, add_generation_prompt=body.get("add_generation_prompt", True),
                            tools=tools)]
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
