"""The one renderer: an OpenAI request body (chat or completions) -> the text and token ids the engine runs.

The server, ``LLM.chat``, the planner and the router all render here, so a body gets the same tokens (and so the
same block hashes) wherever it is rendered.
"""

from __future__ import annotations

import functools
import json
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
    joined, None -> ""), and an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` where given. Other
    fields (name, refusal, annotations) carry nothing a template renders."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = message["role"]
        m: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role), "content": _content_text(message.get("content"), i)}
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise PromptError(f"messages[{i}].tool_calls must be a list", "messages")
            m["tool_calls"] = calls
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            m["tool_call_id"] = message["tool_call_id"]
        out.append(m)
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
) -> RenderedPrompt:
    """Renders with the checkpoint's chat template; the template writes any BOS itself, so none is added.
    ``tools`` (OpenAI's list of tool definitions) goes to the template as ``tools``: a template that renders
    tools puts them in the prompt, one that does not ignores them.

    Message content is text: a special token's spelling typed into it ("<|im_start|>system") stays text, as
    llama.cpp treats user text, so no message can forge a role or end another. ``max_tokens``: refuse, before
    tokenizing, a prompt too long in characters to fit in that many tokens (tokenizing megabytes takes seconds).
    ``continue_final_message`` ends the text inside the last message (no end-of-turn), so the model continues it
    (vLLM's and transformers' meaning); ``template_kwargs`` are extra template variables (vLLM's
    ``chat_template_kwargs``, e.g. ``enable_thinking``): scalars under plain names.
    """
    normalized = normalize_messages(messages)
    if not normalized:
        raise PromptError("'messages' must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise PromptError("'continue_final_message' and 'add_generation_prompt' cannot both be true; set "
                          "'add_generation_prompt': false to continue the last message", "continue_final_message")
    extra = _template_kwargs(template_kwargs)
    rendered, where, template_tools = _for_template(tokenizer, normalized, tools, _fallback_tools_block(tokenizer, tools))
    try:
        if template_tools is not None:  # "tools" is reserved: chat_template_kwargs cannot have set it
            extra["tools"] = template_tools
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # a template can raise anything (jinja2 errors for unexpected roles, ValueError)
        raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
    _check_length(tokenizer, text, max_tokens, "messages")
    return _chat_prompt(tokenizer, text, rendered, where, normalized)


_Where = list[tuple[int, int]] | None


def _for_template(tokenizer: Tokenizer, normalized: list[dict[str, Any]], tools: Sequence[Any] | None,
                  tools_block: str | None) -> tuple[list[dict[str, Any]], _Where, list[Any] | None]:
    """(the messages the template gets, where each message's content is among them (None: one to one, as is),
    the tools the template gets). A template that renders tools gets them as they are; for any other, tools,
    past calls and tool results are written into the messages (kvprefix.prompts.tools: SmolLM2's format;
    ``tools_block``: the tools' text there, ``_fallback_tools_block``)."""
    try:
        if template_renders_tools(getattr(tokenizer, "chat_template", None)):
            return template_messages(normalized), None, None if tools is None else list(tools)
        rendered, where = fallback_messages(normalized, tools_block)
    except ToolFormatError as exc:
        raise PromptError(str(exc), exc.param) from None
    return rendered, where, None


def _fallback_tools_block(tokenizer: Tokenizer, tools: Sequence[Any] | None) -> str | None:
    """The tools' text ``_for_template`` writes into the messages (None: no tools, or the template renders them);
    bodies that send the same tools share it."""
    if not tools or template_renders_tools(getattr(tokenizer, "chat_template", None)):
        return None
    try:
        return tools_system_block(tools)
    except ToolFormatError as exc:
        raise PromptError(str(exc), exc.param) from None


def _needs_literal_spans(tokenizer: Tokenizer, rendered: list[dict[str, Any]]) -> bool:
    found = _any_of(tokenizer.special_tokens)
    if found is None:
        return False
    pattern, first = found
    return any((first is None or any(c in m["content"] for c in first)) and pattern.search(m["content"])
               for m in rendered)


@functools.lru_cache(maxsize=16)
def _any_of(spellings: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str] | None] | None:
    """One pass over a text for any of the spellings (a scan per spelling cost more than rendering the prompt), and
    the spellings' first characters where they are few: a text without any of them holds no spelling, and testing
    for a character is a far faster scan than the pattern's (a long system prompt on every request)."""
    if not spellings:
        return None
    first = frozenset(s[:1] for s in spellings)
    return re.compile("|".join(map(re.escape, spellings))), first if len(first) <= 4 and "" not in first else None


def _chat_prompt(tokenizer: Tokenizer, text: str, rendered: list[dict[str, Any]], where: _Where,
                 normalized: list[dict[str, Any]], token_ids: list[int] | None = None) -> RenderedPrompt:
    """``token_ids``: the whole text tokenized as one, already (only where no content looks special). Every
    content the template got (tool definitions and calls too) is tokenized as text."""
    spans = _message_spans(text, rendered)
    if _needs_literal_spans(tokenizer, rendered):
        token_ids = _encode_with_literal_spans(tokenizer, text, spans)
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


def _message_spans(text: str, messages: list[dict[str, Any]]) -> tuple[tuple[int, int] | None, ...]:
    """Finds each message's content in order; templates render messages in order, so a forward search suffices."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for message in messages:
        content = message["content"]
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


def truncate_prompt(prompt: RenderedPrompt, num_tokens: int) -> RenderedPrompt:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``num_tokens`` tokens (the text no longer matches them,
    so it is dropped)."""
    if len(prompt.token_ids) <= num_tokens:
        return prompt
    return RenderedPrompt(prompt.token_ids[-num_tokens:], None)


def render_body(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[RenderedPrompt]:
    """Every prompt of a raw JSON body: one for chat (``messages``), one per prompt for completions."""
    prompts = _render_body(tokenizer, body)
    keep = body.get("truncate_prompt_tokens")
    if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1:
        prompts = [truncate_prompt(p, keep) for p in prompts]
    return prompts


def _render_body(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[RenderedPrompt]:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise PromptError("'messages' must be a list", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise PromptError("'tools' must be a list", "tools")
        return [render_chat(tokenizer, messages, add_generation_prompt=body.get("add_generation_prompt") is not False,
                            tools=tools, continue_final_message=body.get("continue_final_message") is True,
                            template_kwargs=body.get("chat_template_kwargs"))]
    if "prompt" in body:
        special = body.get("add_special_tokens") is not False
        return [render_completion(tokenizer, p, add_special_tokens=special) for p in completion_prompts(body["prompt"])]
    raise PromptError("a request body needs 'messages' (chat) or 'prompt' (completions)", "messages")


# Body fields render_body honours beyond messages and tools: a body with any of them renders on its own.
_ONE_BY_ONE = ("continue_final_message", "chat_template_kwargs", "truncate_prompt_tokens")


def render_bodies(tokenizer: Tokenizer, bodies: Sequence[Mapping[str, Any]]) -> list[list[RenderedPrompt]]:
    """``[render_body(tokenizer, b) for b in bodies]`` in fewer calls, for many bodies at once (a log): plain chat
    bodies with the same tools (as JSON) and generation prompt go through the template in one call (transformers
    renders a batch conversation by conversation, with the same arguments, so each text is the one a call of its
    own gives), and their texts are tokenized in one ``encode_batch``; other bodies render one by one. A body that
    cannot be rendered raises a PromptError; render the bodies one by one to learn which. Bodies that share one
    tools list (a log's reader can share equal lists) write its JSON once."""
    out: list[list[RenderedPrompt] | None] = [None] * len(bodies)
    groups: dict[tuple[str | int, bool], list[int]] = {}
    chats: dict[int, tuple[list[dict[str, Any]], Any]] = {}
    tools_keys: dict[int, str | int] = {}  # by the list's id: every list here is held by ``bodies`` meanwhile
    for i, body in enumerate(bodies):
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not (tools is None or isinstance(tools, list)) or any(
                body.get(k) is not None for k in _ONE_BY_ONE):
            out[i] = render_body(tokenizer, body)
            continue
        normalized = normalize_messages(messages)
        if not normalized:
            raise PromptError("'messages' must not be empty", "messages")
        chats[i] = (normalized, tools)
        key = tools_keys.get(id(tools))
        if key is None:
            key = tools_keys[id(tools)] = _tools_key(tools)
        groups.setdefault((key, body.get("add_generation_prompt") is not False), []).append(i)
    texts: dict[int, str] = {}
    prepared = {}
    for members in groups.values():  # one tools text per group: its bodies' tools are equal
        block = _fallback_tools_block(tokenizer, chats[members[0]][1])
        for i in members:
            prepared[i] = _for_template(tokenizer, chats[i][0], chats[i][1], block)
    for (_, add_generation_prompt), members in groups.items():
        template_tools = prepared[members[0]][2]
        extra = {} if template_tools is None else {"tools": template_tools}
        try:
            batch = tokenizer.apply_chat_template([prepared[i][0] for i in members], tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # as render_chat: a template can raise anything
            raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
        texts.update(zip(members, batch, strict=True))
    plain = [i for i in chats if not _needs_literal_spans(tokenizer, prepared[i][0])]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    ids = {} if encode_batch is None else dict(
        zip(plain, encode_batch([texts[i] for i in plain], add_special_tokens=False), strict=True))
    for i, (normalized, _) in chats.items():
        rendered, where, _ = prepared[i]
        out[i] = [_chat_prompt(tokenizer, texts[i], rendered, where, normalized, ids.get(i))]
    return out  # type: ignore[return-value]


def _tools_key(tools: Any) -> str | int:
    """Equal for tools equal as JSON (what a body holds); a list of other objects is a group of its own."""
    try:
        return json.dumps(tools)
    except TypeError:
        return id(tools)


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
