"""Where two renderings part, and why: the first differing token, the field it came from, and which cause it
looks like (a short span that changes before content that agrees again, the same items in another order, the
same message spelt differently)."""

from __future__ import annotations

import functools
import json
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

from kvprefix.doctor.items import document_keys, documents, example_pairs, first_difference, moved

# A volatile span is at most this long; the content must agree again for at least MIN_AGREEMENT characters after
# it (a window of WINDOW characters finds where).
MAX_SPAN, WINDOW, MIN_AGREEMENT, ANCHOR = 64, 16, 48, 24
_EXCERPT = 36
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_LOOKS_LIKE = (
    ("a uuid", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)),
    ("a timestamp", re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}")),
    ("a date", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}")),
    ("a time", re.compile(r"\d{1,2}:\d{2}(:\d{2})?")),
    ("a request id", re.compile(r"(req|request|id)[-_:#]?[0-9a-z]{4,}", re.I)),
    ("a hex id", re.compile(r"\b[0-9a-f]{12,}\b", re.I)),
    ("a counter", re.compile(r"^\W*\d+\W*$")),
)


@dataclass
class Rendered:
    token_ids: list[int]
    text: str | None
    fields: list[tuple[str, int, int]]  # (field, start, end): where each field's text sits in ``text``

    @functools.cached_property
    def packed(self) -> bytes:
        """The token ids as uint32 bytes, for fast common-prefix search (only renderings that are compared)."""
        return array("I", self.token_ids).tobytes()


@dataclass(frozen=True)
class VolatileSite:
    """Where a volatile span sits: in field ``field``, after ``before`` and up to ``after`` (either may be "")."""

    field: str
    before: str
    after: str

    def cut(self, content: str) -> tuple[str, str] | None:
        """(content without the span, the span), or None where the site is not in ``content``."""
        start = 0
        if self.before:
            k = content.find(self.before)
            if k < 0:
                return None
            start = k + len(self.before)
        end = content.find(self.after, start, start + MAX_SPAN + len(self.after))
        if end < 0 or end == start:
            return None
        return content[:start] + content[end:], content[start:end]


@dataclass
class Divergence:
    kind: str
    line: int
    other_line: int
    token: int  # first differing token
    field: str | None
    detail: str
    this: str  # excerpts of both renderings, the diverging part between « and »
    other: str
    site: VolatileSite | None = field(default=None, compare=False)
    # What the fix learns from this pair: ("examples" | "documents", both item keys), ("system", first message
    # after the system prompt as JSON), ("head", (this head, the other's)).
    learned: tuple[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "other_line": self.other_line, "token": self.token, "field": self.field,
                "detail": self.detail, "this": self.this, "other": self.other}


def common_prefix(a, b) -> int:
    """Length of the common prefix of two str or bytes: galloping, then bisection, on slice comparisons."""
    n = min(len(a), len(b))
    lo, step = 0, 64  # a[:lo] == b[:lo]
    while lo + step < n and a[lo : lo + step] == b[lo : lo + step]:
        lo += step
        step *= 2
    hi = min(n, lo + step)  # the difference, if any, is in a[lo:hi]
    if a[lo:hi] == b[lo:hi]:
        return hi
    hi -= 1  # a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_tokens(a: Rendered, b: Rendered) -> int:
    return common_prefix(a.packed, b.packed) // 4


def normalized(content: str) -> str:
    """A message's content as the same message however it is spelt: reasoning blocks out, whitespace runs as one
    space."""
    if "<think>" in content:
        content = _THINK.sub("", content)
    return " ".join(content.split())


def looks_like(span: str) -> str:
    return next((name for name, pattern in _LOOKS_LIKE if pattern.search(span)), "a value")


def volatile_span(old: str, new: str) -> tuple[int, int, int] | None:
    """(start, end in old, end in new) of a short span that differs between two contents that agree before it and
    for a while after it; None if they do not."""
    q = common_prefix(old, new)
    if q == len(old) or q == len(new):
        return None
    s = q
    while s > 0 and not old[s - 1].isspace():  # from the start of the word that changed
        s -= 1
    for i in range(q, min(len(old), s + MAX_SPAN) + 1):
        window = old[i : i + WINDOW]
        if len(window) < WINDOW:
            return None
        j = new.find(window, q, s + MAX_SPAN + WINDOW)
        if j >= 0 and common_prefix(old[i:], new[j:]) >= MIN_AGREEMENT:
            # To the end of the word that changed and the whitespace after it, so the cut leaves clean text.
            while i < len(old) and not old[i].isspace():
                i, j = i + 1, j + 1
            while i < len(old) and old[i].isspace():
                i, j = i + 1, j + 1
            return s, i, j
    return None


def excerpt(text: str, start: int, end: int) -> str:
    head = text[max(0, start - _EXCERPT) : start]
    return (("…" if start > _EXCERPT else "") + head + "«" + text[start : min(end, start + MAX_SPAN)] + "»"
            + text[end : end + _EXCERPT // 2]).replace("\n", "⏎")


def _field_at(rendered: Rendered, char: int) -> tuple[str, int, int] | None:
    return next((f for f in rendered.fields if f[1] <= char < f[2]), None)


def classify(new: Rendered, new_body: dict | None, new_line: int, old: Rendered, old_body: dict | None,
             old_line: int, is_last_field, new_tools: str | None = None,
             old_tools: str | None = None) -> Divergence | None:
    """Why ``new`` stops sharing with ``old`` (an earlier request), for the causes content can show; None when
    ``new`` extends ``old`` or the difference looks like different content (no-sharing)."""
    t = common_tokens(new, old)
    if t >= len(new.token_ids) or t >= len(old.token_ids) or new.text is None or old.text is None:
        return None
    p = common_prefix(new.text, old.text)

    def div(kind: str, field_name: str | None, detail: str, span_new: tuple[int, int], span_old: tuple[int, int],
            site: VolatileSite | None = None, learned: tuple[str, Any] | None = None) -> Divergence:
        return Divergence(kind, new_line, old_line, t, field_name, detail, excerpt(new.text, *span_new),
                          excerpt(old.text, *span_old), site, learned)

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
    if here_new is None or here_old is None or here_new[0] != here_old[0]:  # parted outside one field of both
        return None
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
    span = None if is_last_field(name) else volatile_span(a, b)  # the last message is where volatile text belongs
    if span is not None:
        s, end_a, end_b = span
        site = VolatileSite(name, a[max(0, s - ANCHOR) : s], a[end_a : end_a + ANCHOR])
        value = b[s:end_b]
        return div("volatile-prefix", name,
                   f"{name} has {looks_like(value)} ({value.strip()!r} vs {a[s:end_a].strip()!r}) before "
                   f"{len(b) - end_b} characters that every request shares",
                   (start_new + s, start_new + end_b), (start_old + s, start_old + end_a), site)
    return None


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
