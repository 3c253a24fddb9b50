"""The one renderer: chat messages or a completions prompt -> the text and token ids the engine runs.

The server, ``LLM.chat``, the planner and the router all render here, so a body gets the same tokens (and so the
same block hashes) wherever it is rendered.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvprefix.prompts.tools import (
    ToolFormatError,
    fallback_messages,
    template_messages,
    template_renders_tools,
    tools_system_block,
)
from kvprefix.tokenizer.tokenizer import WRAPPER_ARGUMENTS, Tokenizer

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


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as templates expect them: role (developer -> system), content as one string (text parts
    joined by newlines, None -> "", as vLLM's "string" content format), and an assistant's ``tool_calls`` and a
    tool result's ``tool_call_id`` where given. Other fields (name, refusal, annotations) carry nothing a template
    renders."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = message["role"]
        m: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role),
                             "content": "\n".join(_content_parts(message.get("content"), i))}
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise PromptError(f"messages[{i}].tool_calls must be a list", "messages")
            m["tool_calls"] = calls
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            m["tool_call_id"] = message["tool_call_id"]
        out.append(m)
    return out


def _content_parts(content: Any, index: int) -> list[str]:
    """The texts of a message's content: a string is one, None none, a list its text parts'."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise PromptError(f"messages[{index}].content: only text parts are supported, got {kind!r}",
                                  "messages")
            texts.append(part["text"])
        return texts
    raise PromptError(f"messages[{index}].content must be a string or a list of text parts", "messages")


# Names the chat template sees from the renderer itself, or that transformers' apply_chat_template takes as its
# own arguments (a "chat_template" key would have replaced the template): chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = WRAPPER_ARGUMENTS | {
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "bos_token",
    "eos_token", "raise_exception",
}
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
    *,
    tools: Sequence[Any] | None = None,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    documents: Sequence[Mapping[str, str]] | None = None,
    add_special_tokens: bool = False,
) -> RenderedPrompt:
    """Renders with the checkpoint's chat template; the template writes any BOS itself, so none is added.
    ``tools`` (OpenAI's list of tool definitions) goes to the template as ``tools``: a template that renders
    tools puts them in the prompt, one that does not ignores them.

    Message content is text: a special token's spelling typed into it ("<|im_start|>system") stays text, as
    llama.cpp treats user text, so no message can forge a role or end another. ``max_tokens``: refuse, before
    tokenizing, a prompt too long in characters to fit in that many tokens (tokenizing megabytes takes seconds).
    ``continue_final_message`` ends the text inside the last message (no end-of-turn), so the model continues it
    (vLLM's and transformers' meaning); ``template_kwargs`` are extra template variables (vLLM's
    ``chat_template_kwargs``, e.g. ``enable_thinking``): scalars under plain names. ``documents`` go to the
    template as ``documents`` (RAG templates); ``add_special_tokens`` adds the tokenizer's BOS/EOS around the
    rendered text (vLLM's chat default is False: the template writes its own).
    """
    normalized = normalize_messages(messages)
    if not normalized:
        raise PromptError("'messages' must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise PromptError("'continue_final_message' and 'add_generation_prompt' cannot both be true; set "
                          "'add_generation_prompt': false to continue the last message", "continue_final_message")
    extra = _template_kwargs(template_kwargs)
    docs = None if documents is None else _documents(documents)
    prepared = prepare_messages(tokenizer, messages, normalized, tools, _fallback_tools_block(tokenizer, tools))
    try:
        if prepared.tools is not None:  # "tools" is reserved: chat_template_kwargs cannot have set it
            extra["tools"] = prepared.tools
        if documents is not None:
            extra["documents"] = docs
        text = tokenizer.apply_chat_template(prepared.messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # a template can raise anything (jinja2 errors for unexpected roles, ValueError)
        raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
    _check_length(tokenizer, text, max_tokens, "messages")
    prompt = _chat_prompt(tokenizer, text, prepared, normalized)
    return _with_special_tokens(tokenizer, prompt) if add_special_tokens else prompt


def _documents(documents: Any) -> list[dict[str, str]]:
    if not isinstance(documents, (list, tuple)) or not all(
            isinstance(d, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in documents):
        raise PromptError("'documents' must be a list of objects of strings", "documents")
    return [dict(d) for d in documents]


def _with_special_tokens(tokenizer: Tokenizer, prompt: RenderedPrompt) -> RenderedPrompt:
    """The prompt with the special tokens the tokenizer adds to any text (its BOS, perhaps an EOS): what encoding
    the whole text with ``add_special_tokens=True`` gives, also where message contents were tokenized apart."""
    probe = tokenizer.encode("a", add_special_tokens=False)
    wrapped = tokenizer.encode("a", add_special_tokens=True)
    at = next((i for i in range(len(wrapped) - len(probe) + 1) if wrapped[i : i + len(probe)] == probe), 0)
    head, tail = wrapped[:at], wrapped[at + len(probe):]
    return RenderedPrompt([*head, *prompt.token_ids, *tail], prompt.text, prompt.message_spans)


_Where = list[tuple[int, int]] | None


@dataclass(frozen=True)
class PreparedMessages:
    """A request's messages made ready for the template: ``messages`` what it gets (content in its format),
    ``rendered`` the same with each content one string, ``where`` where each request message's content is among
    them (None: one to one, as is), ``tools`` the tools it gets, ``texts`` every text of the messages it gets
    (tokenized as text, never as special tokens)."""

    messages: list[dict[str, Any]]
    rendered: list[dict[str, Any]]
    where: _Where
    tools: list[Any] | None
    texts: list[str]


def prepare_messages(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], normalized: list[dict[str, Any]],
                     tools: Sequence[Any] | None, tools_block: str | None) -> PreparedMessages:
    """A template that renders tools gets them as they are; for any other, tools, past calls and tool results are
    written into the messages (kvprefix.prompts.tools: SmolLM2's format; ``tools_block``: the tools' text there,
    ``_fallback_tools_block``). Content reaches the template in the format it takes (``Tokenizer.content_format``):
    one string, or (vLLM's "openai" format) a list of text parts: the request's own parts, a string as one part,
    none for a null content; a message written here (tools, calls) as one part, a tool result as its string."""
    template_tools = None
    try:
        if template_renders_tools(getattr(tokenizer, "chat_template", None)):
            rendered, where = template_messages(normalized), None
            template_tools = None if tools is None else list(tools)
        else:
            rendered, where = fallback_messages(normalized, tools_block)
    except ToolFormatError as exc:
        raise PromptError(str(exc), exc.param) from None
    if tokenizer.content_format(template_tools) != "openai":
        return PreparedMessages(rendered, rendered, where, template_tools, [m["content"] for m in rendered])
    source: list[int | None] = list(range(len(rendered)))  # the request message each one's content is from
    if where is not None:
        source = [None] * len(rendered)
        for i, (j, _) in enumerate(where):
            source[j] = i
    out, texts = [], []
    for m, i in zip(rendered, source, strict=True):
        if m["role"] == "tool":
            out.append(m)
            texts.append(m["content"])
            continue
        own = i is not None and m["content"] == normalized[i]["content"]
        parts = _content_parts(messages[i].get("content"), i) if own else [m["content"]]
        out.append({**m, "content": [{"type": "text", "text": t} for t in parts]})
        texts += parts
    return PreparedMessages(out, rendered, where, template_tools, texts)


def _fallback_tools_block(tokenizer: Tokenizer, tools: Sequence[Any] | None) -> str | None:
    """The tools' text ``_for_template`` writes into the messages (None: no tools, or the template renders them);
    bodies that send the same tools share it."""
    if not tools or template_renders_tools(getattr(tokenizer, "chat_template", None)):
        return None
    try:
        return tools_system_block(tools)
    except ToolFormatError as exc:
        raise PromptError(str(exc), exc.param) from None


def _needs_literal_spans(tokenizer: Tokenizer, texts: list[str]) -> bool:
    found = _any_of(tokenizer.special_tokens)
    if found is None:
        return False
    pattern, first = found
    return any((first is None or any(c in t for c in first)) and pattern.search(t) for t in texts)


@functools.lru_cache(maxsize=16)
def _any_of(spellings: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str] | None] | None:
    """One pass over a text for any of the spellings (a scan per spelling cost more than rendering the prompt), and
    the spellings' first characters where they are few: a text without any of them holds no spelling, and testing
    for a character is a far faster scan than the pattern's (a long system prompt on every request)."""
    if not spellings:
        return None
    first = frozenset(s[:1] for s in spellings)
    return re.compile("|".join(map(re.escape, spellings))), first if len(first) <= 4 and "" not in first else None


def _chat_prompt(tokenizer: Tokenizer, text: str, prepared: PreparedMessages, normalized: list[dict[str, Any]],
                 token_ids: list[int] | None = None) -> RenderedPrompt:
    """``token_ids``: the whole text tokenized as one, already (only where no content looks special). Every
    content the template got (tool definitions and calls too) is tokenized as text."""
    rendered, where = prepared.rendered, prepared.where
    spans = _message_spans(text, [m["content"] for m in rendered])
    if _needs_literal_spans(tokenizer, prepared.texts):
        token_ids = _encode_with_literal_spans(tokenizer, text, _literal_spans(tokenizer, text, prepared.texts))
    elif token_ids is None:  # the usual case: nothing in the content looks special, so the text tokenizes as one
        token_ids = tokenizer.encode(text, add_special_tokens=False)
    if where is not None:  # the span of each request message's own content within what the template got
        spans = tuple(None if spans[j] is None or not m["content"] else
                      (spans[j][0] + offset, spans[j][0] + offset + len(m["content"]))
                      for m, (j, offset) in zip(normalized, where, strict=True))
    return RenderedPrompt(token_ids, text, spans)


def _template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if not kwargs:
        return {}
    if not isinstance(kwargs, Mapping) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise PromptError(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} entries",
                          "chat_template_kwargs")
    for key, value in kwargs.items():
        if not (isinstance(key, str) and key.isidentifier() and key.isascii() and len(key) <= 64):
            raise PromptError(f"'chat_template_kwargs' key {key!r} is not a plain name", "chat_template_kwargs")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise PromptError(f"'chat_template_kwargs' may not set {key!r}; it is set by the request itself",
                              "chat_template_kwargs")
        scalar = value is None or isinstance(value, (bool, int, float)) or (
            isinstance(value, str) and len(value) <= MAX_TEMPLATE_KWARG_CHARS)
        if not scalar:
            raise PromptError(f"'chat_template_kwargs.{key}' must be a string (at most {MAX_TEMPLATE_KWARG_CHARS} "
                              "characters), a number, a boolean or null", "chat_template_kwargs")
    return dict(kwargs)


def _literal_spans(tokenizer: Tokenizer, text: str, texts: list[str]) -> list[tuple[int, int] | None]:
    """Where each of ``texts`` (the messages' texts, in order) is in ``text``, never a match that cuts through a
    special token the template wrote (a short text such as "a" is also in "<|im_start|>"); None where not found."""
    pattern = _any_of(tokenizer.special_tokens)[0]
    marks = [(m.start(), m.end()) for m in pattern.finditer(text)]
    starts = [a for a, _ in marks]

    def cuts(position: int) -> bool:
        k = bisect.bisect_left(starts, position) - 1  # the last special token that starts before ``position``
        return k >= 0 and marks[k][1] > position

    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for piece in texts:
        start = text.find(piece, cursor) if piece else -1
        while start >= 0 and (cuts(start) or cuts(start + len(piece))):
            start = text.find(piece, start + 1)
        if start < 0:
            spans.append(None)
            continue
        cursor = start + len(piece)
        spans.append((start, cursor))
    return spans


def _encode_with_literal_spans(tokenizer: Tokenizer, text: str, spans) -> list[int]:
    """The template's own text with its special tokens, each message's content as plain text."""
    parts: list[tuple[str, bool]] = []  # (text, whether special tokens in it are parsed)
    cursor = 0
    for span in spans:
        if span is None:
            continue
        start, end = span
        parts += [(text[cursor:start], True), (text[start:end], False)]
        cursor = end
    parts.append((text[cursor:], True))
    return tokenizer.encode_parts(parts)


def _check_length(tokenizer: Tokenizer, text: str, max_tokens: int | None, param: str) -> None:
    if max_tokens is not None and len(text) > max_tokens * tokenizer.max_chars_per_token:
        raise PromptError(
            f"this model's maximum context length is {max_tokens} tokens, but the prompt has {len(text)} "
            f"characters, more than {max_tokens} tokens can hold", param, code="context_length_exceeded")


def _message_spans(text: str, contents: list[str]) -> tuple[tuple[int, int] | None, ...]:
    """Finds each content in order; templates render messages in order, so a forward search suffices."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for content in contents:
        start = _find(text, content, cursor) if content else -1
        if start < 0:
            spans.append(None)
            continue
        cursor = start + len(content)
        spans.append((start, cursor))
    return tuple(spans)


_HEAD = 64  # characters of a content searched for before the whole content is compared
_HEAD_TRIES = 4


def _find(text: str, content: str, start: int) -> int:
    """``text.find(content, start)``, faster for a long content: CPython prepares a long needle before searching
    (about as long as rendering a long system prompt), a short one not. So find the content's head and compare the
    rest there; after a few heads that were not the content, the plain search (linear whatever the text)."""
    if len(content) <= _HEAD:
        return text.find(content, start)
    head = content[:_HEAD]
    for _ in range(_HEAD_TRIES):
        start = text.find(head, start)
        if start < 0 or text.startswith(content, start):
            return start
        start += 1
    return text.find(content, start)


def render_completion(
    tokenizer: Tokenizer, prompt: str | Sequence[int], max_tokens: int | None = None, add_special_tokens: bool = True
) -> RenderedPrompt:
    """A completions prompt: text is tokenized with the tokenizer's special tokens (BOS, unless
    ``add_special_tokens`` is False; special tokens written in it are parsed, since a raw prompt is where a caller
    writes its own template), token ids pass as is. ``max_tokens`` as for ``render_chat``."""
    if isinstance(prompt, str):
        _check_length(tokenizer, prompt, max_tokens, "prompt")
        return RenderedPrompt(tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt)
    return RenderedPrompt(list(prompt), None)
