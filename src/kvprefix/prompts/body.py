"""The one adapter from an OpenAI request body to the prompts a replica runs: the server, the router, the planner and
the doctor all call ``render_body`` (or ``render_bodies``), so a body gives the same token ids, and so the same block
hashes, wherever it is read.

Every field that changes the prompt has vLLM's meaning: ``messages`` with ``tools``, ``documents``,
``chat_template_kwargs``, ``add_generation_prompt`` (default true), ``continue_final_message`` and
``add_special_tokens`` (chat: default false), ``prompt`` with ``add_special_tokens`` (completions: default true),
``truncate_prompt_tokens`` (keep the last k tokens, or the first k with ``truncation_side`` "right"; -1 keeps the
context length, ``max_model_len``). A request
``chat_template`` is refused, as vLLM refuses it without ``--trust-request-chat-template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvprefix.prompts.render import (
    PromptError,
    RenderedPrompt,
    _chat_prompt,
    _fallback_tools_block,
    _needs_literal_spans,
    normalize_messages,
    prepare_messages,
    render_chat,
    render_completion,
)
from kvprefix.tokenizer.tokenizer import Tokenizer


def truncate_prompt(prompt: RenderedPrompt, num_tokens: int, side: str = "left") -> RenderedPrompt:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``num_tokens`` tokens (``side`` "left": cut on the left),
    or the first (``side`` "right"); the text no longer matches them, so it is dropped."""
    if len(prompt.token_ids) <= num_tokens:
        return prompt
    ids = prompt.token_ids[-num_tokens:] if side == "left" else prompt.token_ids[:num_tokens]
    return RenderedPrompt(ids, None)


def render_body(tokenizer: Tokenizer, body: Mapping[str, Any], max_model_len: int | None = None, *,
                refuse_long: bool = False) -> list[RenderedPrompt]:
    """Every prompt of a JSON body: one for chat (``messages``), one per prompt for completions.

    ``max_model_len`` is the replica's context length: ``truncate_prompt_tokens`` -1 keeps that many tokens, and
    more than that is refused (without it, -1 is refused: the prompt it gives is unknown). ``refuse_long``: refuse,
    before tokenizing, a text too long for ``max_model_len`` tokens unless the body truncates (the server's check).
    """
    keep = _kept_tokens(body, max_model_len)
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise PromptError("'truncation_side' must be \"left\" (keep the last tokens) or \"right\" (the first)",
                          "truncation_side")
    prompts = _render_body(tokenizer, body, max_model_len if refuse_long and keep is None else None)
    return prompts if keep is None else [truncate_prompt(p, keep, side) for p in prompts]


def _kept_tokens(body: Mapping[str, Any], max_model_len: int | None) -> int | None:
    keep = body.get("truncate_prompt_tokens")
    if keep is None:
        return None
    if not isinstance(keep, int) or isinstance(keep, bool) or keep == 0 or keep < -1:
        raise PromptError("'truncate_prompt_tokens' must be -1 (the context length) or at least 1",
                          "truncate_prompt_tokens")
    if keep == -1:
        if max_model_len is None:
            raise PromptError("'truncate_prompt_tokens': -1 keeps the replica's context length, which is not known "
                              "here", "truncate_prompt_tokens")
        return max_model_len
    if max_model_len is not None and keep > max_model_len:
        raise PromptError(f"'truncate_prompt_tokens' ({keep}) is over this model's maximum context length "
                          f"({max_model_len})", "truncate_prompt_tokens")
    return keep


def _render_body(tokenizer: Tokenizer, body: Mapping[str, Any], limit: int | None) -> list[RenderedPrompt]:
    if "messages" in body:
        messages, tools = body["messages"], body.get("tools")
        if not isinstance(messages, list):
            raise PromptError("'messages' must be a list", "messages")
        if tools is not None and not isinstance(tools, list):
            raise PromptError("'tools' must be a list", "tools")
        if body.get("chat_template") is not None:
            raise PromptError("'chat_template' is not accepted: prompts are rendered with the model's own template "
                              "(as vLLM without --trust-request-chat-template)", "chat_template")
        return [render_chat(tokenizer, messages, add_generation_prompt=body.get("add_generation_prompt") is not False,
                            max_tokens=limit, tools=tools,
                            continue_final_message=body.get("continue_final_message") is True,
                            template_kwargs=body.get("chat_template_kwargs"), documents=body.get("documents"),
                            add_special_tokens=body.get("add_special_tokens") is True)]
    if "prompt" in body:
        special = body.get("add_special_tokens") is not False
        return [render_completion(tokenizer, p, limit, add_special_tokens=special)
                for p in completion_prompts(body["prompt"])]
    raise PromptError("a request body needs 'messages' (chat) or 'prompt' (completions)", "messages")


# Body fields beyond messages, tools and the generation prompt: a body with any of them renders on its own.
_ONE_BY_ONE = ("continue_final_message", "chat_template_kwargs", "truncate_prompt_tokens", "documents",
               "add_special_tokens", "chat_template")


def render_bodies(tokenizer: Tokenizer, bodies: Sequence[Mapping[str, Any]],
                  max_model_len: int | None = None) -> list[list[RenderedPrompt]]:
    """``[render_body(tokenizer, b, max_model_len) for b in bodies]`` in fewer calls, for many bodies at once (a
    log): plain chat bodies with the same tools (as JSON) and generation prompt go through the template in one call
    (transformers renders a batch conversation by conversation, so each text is the one a call of its own gives),
    and their texts are tokenized in one ``encode_batch``; other bodies render one by one. A body that cannot be
    rendered raises a PromptError; render the bodies one by one to learn which."""
    out: list[list[RenderedPrompt] | None] = [None] * len(bodies)
    groups: dict[tuple[str | int, bool], list[int]] = {}
    chats: dict[int, tuple[list[dict[str, Any]], Any]] = {}
    tools_keys: dict[int, str | int] = {}  # by the list's id: every list here is held by ``bodies`` meanwhile
    for i, body in enumerate(bodies):
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not (tools is None or isinstance(tools, list)) or any(
                body.get(k) is not None for k in _ONE_BY_ONE):
            out[i] = render_body(tokenizer, body, max_model_len)
            continue
        normalized = normalize_messages(messages)
        if not normalized:
            raise PromptError("'messages' must not be empty", "messages")
        chats[i] = (messages, normalized, tools)
        key = tools_keys.get(id(tools))
        if key is None:
            key = tools_keys[id(tools)] = _tools_key(tools)
        groups.setdefault((key, body.get("add_generation_prompt") is not False), []).append(i)
    _render_groups(tokenizer, groups, chats, out)
    return out  # type: ignore[return-value]


def _render_groups(tokenizer: Tokenizer, groups: dict[tuple[str | int, bool], list[int]],
                   chats: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]], Any]], out: list) -> None:
    """Renders each group's chats with one template call, tokenizes the plain texts in one batch, into ``out``."""
    texts: dict[int, str] = {}
    prepared = {}
    for members in groups.values():  # one tools text per group: its bodies' tools are equal
        block = _fallback_tools_block(tokenizer, chats[members[0]][2])
        for i in members:
            prepared[i] = prepare_messages(tokenizer, *chats[i], block)
    for (_, add_generation_prompt), members in groups.items():
        template_tools = prepared[members[0]].tools
        extra = {} if template_tools is None else {"tools": template_tools}
        try:
            batch = tokenizer.apply_chat_template([prepared[i].messages for i in members], tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # as render_chat: a template can raise anything
            raise PromptError(f"cannot render 'messages' with the model's chat template: {exc}", "messages") from None
        texts.update(zip(members, batch, strict=True))
    plain = [i for i in chats if not _needs_literal_spans(tokenizer, prepared[i].texts)]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    ids = {} if encode_batch is None else dict(
        zip(plain, encode_batch([texts[i] for i in plain], add_special_tokens=False), strict=True))
    for i, (_, normalized, _) in chats.items():
        out[i] = [_chat_prompt(tokenizer, texts[i], prepared[i], normalized, ids.get(i))]


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
