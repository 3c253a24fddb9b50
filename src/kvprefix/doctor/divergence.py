"""Where two renderings part, and why: the first differing token, the field it came from, and which cause it
looks like (spans that change before content that other requests share, the same items in another order, the
same message spelt differently)."""

from __future__ import annotations

import functools
import json
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvprefix.doctor.items import document_keys, documents, example_pairs, first_difference, moved
from kvprefix.doctor.volatile import (
    MAX_SPANS,
    Lines,
    VolatileSite,
    common_prefix,
    looks_like,
    parts,
    site,
    word_start,
)

_EXCERPT = 36
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclass
class Rendered:
    token_ids: list[int]
    text: str | None
    fields: list[tuple[str, int, int]]  # (field, start, end): where each field's text sits in ``text``

    @functools.cached_property
    def packed(self) -> bytes:
        """The token ids as uint32 bytes, for fast common-prefix search (only renderings that are compared)."""
        return array("I", self.token_ids).tobytes()


@dataclass
class Divergence:
    kind: str
    line: int
    other_line: int
    token: int  # first differing token
    field: str | None
    detail: str | Callable[[], str]  # or what writes it, only for the pair kept as the example
    this: str  # excerpts of both renderings, the diverging part between « and »
    other: str
    sites: tuple[VolatileSite, ...] = field(default=(), compare=False)
    # What the fix learns from this pair: ("examples" | "documents", both item keys), ("system", first message
    # after the system prompt as JSON), ("head", (this head, the other's)).
    learned: tuple[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "other_line": self.other_line, "token": self.token, "field": self.field,
                "detail": self.detail() if callable(self.detail) else self.detail, "this": self.this,
                "other": self.other}


def common_tokens(a: Rendered, b: Rendered) -> int:
    return common_prefix(a.packed, b.packed) // 4


def normalized(content: str) -> str:
    """A message's content as the same message however it is spelt: reasoning blocks out, whitespace runs as one
    space."""
    if "<think>" in content:
        content = _THINK.sub("", content)
    return " ".join(content.split())


def excerpt(text: str, start: int, end: int) -> str:
    head = text[max(0, start - _EXCERPT) : start]
    span = text[start:end]
    if len(span) > 2 * _EXCERPT:
        span = span[:_EXCERPT] + "…" + span[-_EXCERPT // 2 :]
    return (("…" if start > _EXCERPT else "") + head + "«" + span + "»" + text[end : end + _EXCERPT // 2]).replace(
        "\n", "⏎")


def _field_at(rendered: Rendered, char: int) -> tuple[str, int, int] | None:
    return next((f for f in rendered.fields if f[1] <= char < f[2]), None)


def classify(new: Rendered, new_body: dict | None, new_line: int, old: Rendered, old_body: dict | None,
             old_line: int, new_tools: str | None = None, old_tools: str | None = None,
             lines: Lines | None = None) -> Divergence | None:
    """Why ``new`` stops sharing with ``old`` (an earlier request), for the causes content can show; None when
    ``new`` extends ``old`` or the difference looks like different content (no-sharing). ``lines``: the lines
    earlier requests carry."""
    t = common_tokens(new, old)
    if t >= len(new.token_ids) or t >= len(old.token_ids) or new.text is None or old.text is None:
        return None
    p = common_prefix(new.text, old.text)

    def div(kind: str, field_name: str | None, detail: str | Callable[[], str], span_new: tuple[int, int],
            span_old: tuple[int, int], sites: tuple[VolatileSite, ...] = (),
            learned: tuple[str, Any] | None = None) -> Divergence:
        return Divergence(kind, new_line, old_line, t, field_name, detail, excerpt(new.text, *span_new),
                          excerpt(old.text, *span_old), sites, learned)

    here_new, here_old = _field_at(new, p), _field_at(old, p)
    if new_tools is not None and old_tools is not None and new_tools != old_tools:
        tools = _tools_order(new_body.get("tools"), old_body.get("tools"))
        if tools is not None and (here_new is None or here_new[0] == "tools"):
            return div("reordered", "tools", tools, (p, p + 24), (p, p + 24))
    new_messages, old_messages = _messages(new_body), _messages(old_body)
    if new_messages is not None and old_messages is not None:
        d = _system_prompt_drift(new, old, p, new_messages, old_messages, div)
        d = d or _reordered_examples(here_new, p, new_messages, old_messages, div)
        if d is not None:
            return d
    elif new_body is None and old_body is None:
        d = _template_head_drift(new, old, p, div)
        if d is not None:
            return d
    if here_new is not None and here_old is not None and here_new[0] == here_old[0]:  # in one field of both
        d = _same_field(new, old, p, here_new, here_old, div)
        if d is not None:
            return d
    return _volatile(new, new_body, old, old_body, p, div, lines)


def _same_field(new: Rendered, old: Rendered, p: int, here_new, here_old, div) -> Divergence | None:
    """The same message spelt differently, its documents or JSON keys in another order."""
    name, start_new, end_new = here_new
    _, start_old, end_old = here_old
    a, b = old.text[start_old:end_old], new.text[start_new:end_new]
    if a != b and normalized(a) == normalized(b):
        what = "a reasoning block is in one and not the other" if _THINK.search(a + b) else "whitespace differs"
        return div("template-drift", name, f"the same {name} rendered differently: {what}", (p, end_new),
                   (p, end_old))
    docs = _reordered_documents(name, a, b, p - start_new, div, (p, p + 24), (p, p + 24))
    if docs is not None:
        return docs
    if _same_json(a, b):
        return div("reordered", name, f"the same JSON object in {name} with its keys in another order",
                   (p, p + 24), (p, p + 24))
    return None


def _volatile(new: Rendered, new_body: dict | None, old: Rendered, old_body: dict | None, p: int, div,
              lines: Lines | None) -> Divergence | None:
    """The volatile spans where the renderings part (``volatile.parts``), each inside one field of both: a
    message's content (bodies: its site in that content; a request log's text: in the whole text, where its fix
    cuts), or (bodies) a string of the tools, found by comparing the two tools lists string by string."""
    stop = new.fields[-1][2] if new.fields else len(new.text)  # the template's closing is no shared content
    carried = lines.carried(new.text, new.fields) if lines is not None else None
    carried_old = lines.carried(old.text, old.fields) if lines is not None else None
    sites: list[VolatileSite] = []
    shown: tuple[str | None, int, int, int, int] | None = None
    tools_done = False
    for s, e, s_old, e_old in parts(new.text, old.text, p, stop, carried, carried_old):
        here, there = _field_at(new, s), _field_at(old, s_old)
        if here is not None and there is not None and here[0] == there[0] and (
                max(e - here[2], 0) == max(e_old - there[2], 0)):  # both end in the field, or past it alike
            name, start, end = here
            e, e_old = min(e, end), min(e_old, there[2])
            line = carried.line_key(s) if carried is not None else 0
            if new_body is not None:
                sites.append(site(name, new.text[start:end], s - start, e - start, line))
            else:
                sites.append(site(name, new.text, s, e, line))
        elif here is None and new_body is not None and old_body is not None and not tools_done:
            tools_done = True
            new_tools, old_tools = new_body.get("tools"), old_body.get("tools")
            if not (isinstance(new_tools, list) and isinstance(old_tools, list)) or _tools_order(
                    new_tools, old_tools) is not None:  # no tools, or the same tools in another order
                continue
            found = _tool_sites(new_tools, old_tools)
            if not found:
                continue
            sites += found
            name = found[0].field
        elif here is None and new_body is None:
            name = None
            sites.append(site(None, new.text, s, e))
        else:
            continue
        if shown is None:
            shown = (name, s, e, s_old, e_old)
    if shown is None:
        return None
    name, s, e, s_old, e_old = shown
    value, other = new.text[s:e], old.text[s_old:e_old]
    more = f" (and {len(sites) - 1} more volatile spans)" if len(sites) > 1 else ""
    return div("volatile-prefix", name, lambda: f"{name or 'the template text'} has {looks_like(value)} "
               f"({_short(value)!r} vs {_short(other)!r}) before content that other requests share{more}",
               (s, e), (s_old, e_old), tuple(sites))


def _short(value: str) -> str:
    value = value.strip()
    return value if len(value) <= 2 * _EXCERPT else value[:_EXCERPT] + "…" + value[-_EXCERPT // 2 :]


def _tool_sites(new: Any, old: Any) -> list[VolatileSite]:
    """The sites of the volatile spans of two tools lists that differ only in strings (a few), per string."""
    leaves: list[tuple[str, str, str]] = []
    if not _differing_strings(new, old, "tools", leaves) or len(leaves) > MAX_SPANS:
        return []
    out = []  # a part of a string, never the whole: a name or a value that differs is another tool, not volatile
    for path, a, b in leaves:
        q = common_prefix(a, b)
        r = min(common_prefix(a[::-1], b[::-1]), len(a) - q, len(b) - q)
        s, e = word_start(a, q, 0), len(a) - r
        while e < len(a) and not a[e].isspace():  # over the shared end: to the end of the word and its space
            e += 1
        while e < len(a) and a[e].isspace():
            e += 1
        if 0 < s or e < len(a):
            out.append(site(path, a, s, e))
    return out


_PLAIN_KEY = re.compile(r"[A-Za-z_][\w-]*")


def _differing_strings(a: Any, b: Any, path: str, out: list[tuple[str, str, str]]) -> bool:
    """Adds (path, a's, b's) for each string where ``a`` and ``b`` differ; False where they differ otherwise (in
    shape, keys, numbers) or at a key the path cannot name."""
    if isinstance(a, str) and isinstance(b, str):
        if a != b:
            out.append((path, a, b))
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(
            a[k] == b[k] or (_PLAIN_KEY.fullmatch(k) is not None and _differing_strings(a[k], b[k], f"{path}.{k}", out))
            for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_differing_strings(x, y, f"{path}[{k}]", out)
                                        for k, (x, y) in enumerate(zip(a, b, strict=True)))
    return a == b


def _messages(body: dict | None) -> list | None:
    messages = body.get("messages") if body is not None else None
    return messages if isinstance(messages, list) and messages else None


def system_message(messages: list) -> tuple[Any, int]:
    """(the system message's content or None where none is sent, index of the first message after it)."""
    m = messages[0]
    if isinstance(m, dict) and m.get("role") in ("system", "developer"):
        return m.get("content"), 1
    return None, 0


def _same_message(a: Any, b: Any) -> bool:
    return isinstance(a, dict) and isinstance(b, dict) and (a.get("role"), a.get("content")) == (
        b.get("role"), b.get("content"))


def conversation_key(message: Any) -> str:
    """The first message after the system prompt, as JSON: what names a conversation for the system prompt fix."""
    return json.dumps([message.get("role"), message.get("content")], ensure_ascii=False)


def _system_prompt_drift(new: Rendered, old: Rendered, p: int, new_messages: list, old_messages: list, div):
    """The same conversation (the same first message after the system prompt) sent once without a system message
    (the template writes its default system prompt, or none) and once with one."""
    (sys_new, first_new), (sys_old, first_old) = system_message(new_messages), system_message(old_messages)
    if (sys_new is None) == (sys_old is None) or first_new >= len(new_messages) or first_old >= len(
            old_messages) or not _same_message(new_messages[first_new], old_messages[first_old]):
        return None
    implicit, explicit = (new, old) if sys_new is None else (old, new)
    ends = {id(r): (r.fields[0][2] if r is explicit else r.fields[0][1]) if r.fields else p + 24 for r in (new, old)}
    return div("template-drift", "messages[0].content",
               "the same conversation sent without a system message (the template's default system prompt, if it "
               "has one) and with an explicit one", (p, ends[id(new)]), (p, ends[id(old)]),
               learned=("system", conversation_key(new_messages[first_new])))


def _reordered_examples(here_new, p: int, new_messages: list, old_messages: list, div):
    """The same few-shot examples (user/assistant pairs after the system prompt) in another order."""
    (first, new_keys), (first_old, old_keys) = example_pairs(new_messages), example_pairs(old_messages)
    if first != first_old or len(new_keys) < 2 or len(old_keys) < 2:
        return None
    items = moved(new_keys, old_keys)
    if not items:
        return None
    k = first + 2 * first_difference(new_keys, old_keys)
    name = f"messages[{k}].content"
    if here_new is None or here_new[0] not in (name, f"messages[{k + 1}].content"):
        return None
    return div("reordered", name, f"the same {len(items)} few-shot examples (user/assistant pairs from messages[{k}]) "
               "in another order", (p, p + 24), (p, p + 24), learned=("examples", frozenset(new_keys + old_keys)))


def _reordered_documents(name: str, old_content: str, new_content: str, offset: int, div, span_new, span_old):
    """The same documents in one message's content in another order, nothing before them differing."""
    new_items, old_items = documents(new_content), documents(old_content)
    if not new_items or not old_items:
        return None
    new_keys, old_keys = document_keys(new_content, new_items), document_keys(old_content, old_items)
    items = moved(new_keys, old_keys)
    if not items:
        return None
    j = first_difference(new_keys, old_keys)
    if offset < new_items[j][0]:
        return None
    return div("reordered", name, f"the same {len(items)} documents in {name} in another order", span_new, span_old,
               learned=("documents", frozenset(new_keys + old_keys)))


def _template_head_drift(new: Rendered, old: Rendered, p: int, div):
    """A rendered text (a request log's) whose template text before the first message differs while that message
    is the same: the template's default system prompt (or what else it writes there) changed."""
    if not new.fields or not old.fields or new.fields[0][0] != old.fields[0][0] or new.fields[0][0] == "prompt":
        return None
    (_, hn, en), (_, ho, eo) = new.fields[0], old.fields[0]
    if not (p < hn and p < ho) or new.text[hn:en] != old.text[ho:eo]:
        return None
    return div("template-drift", None, "the template's text before messages[0] differs (a changed default system "
               "prompt): the same messages rendered differently", (p, hn), (p, ho),
               learned=("head", (new.text[:hn], old.text[:ho])))


def _tools_order(new: Any, old: Any) -> str | None:
    """What differs between two tools lists that hold the same tools; None if they are equal or not the same."""
    if len(new) != len(old):
        return None
    canon_new = [json.dumps(t, sort_keys=True) for t in new]
    canon_old = [json.dumps(t, sort_keys=True) for t in old]
    if sorted(canon_new) != sorted(canon_old):
        return None
    if canon_new != canon_old:
        return f"the same {len(new)} tools in another order: {_tool_names(new)} vs {_tool_names(old)}"
    i = next(k for k, (x, y) in enumerate(zip(new, old, strict=True)) if json.dumps(x) != json.dumps(y))
    return f"tools[{i}] ({_tool_names([new[i]])[0]}): the same schema with its JSON keys in another order"


def _tool_names(tools: list) -> list[str]:
    def name(t: Any) -> str:
        fn = t.get("function") if isinstance(t, dict) else None
        return str(fn.get("name")) if isinstance(fn, dict) else "?"

    return [name(t) for t in tools]


def _same_json(a: str, b: str) -> bool:
    if not (a.lstrip().startswith(("{", "[")) and b.lstrip().startswith(("{", "["))):
        return False
    try:
        return json.loads(a) == json.loads(b) and a != b
    except ValueError:
        return False
