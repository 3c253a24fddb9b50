"""The fixes, as transformations of a log entry's body (or rendered text): volatile span to the end; one order of
tools, JSON keys, few-shot examples and documents; one spelling per message; one system prompt per conversation.
Each returns a new body, or the same object when it changes nothing (only what a fix touched is rendered again).
Order and spelling fixes keep the first seen, so a consistent log is left as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from kvprefix.doctor.divergence import conversation_key, normalized, system_message
from kvprefix.doctor.items import document_keys, documents, example_pairs, reorder, reorder_documents
from kvprefix.doctor.volatile import VolatileSite
from kvprefix.logs import SharedTools


class MoveVolatileToEnd:
    """Cuts each known volatile span out of its field (a message's content, the prompt, a string of the tools)
    and appends it to the end of the prompt (the last message, or the prompt text), where it no longer breaks the
    prefix of what follows."""

    def __init__(self, sites: Iterable[VolatileSite]):
        # Per field, per place (the text before a span), the sites there: at one place the shortest span found is
        # cut (a pair that parts early and meets late, two system prompts before the same tools, proposes a span
        # that holds the volatile one).
        self.by_field: dict[str | None, dict[str, list[VolatileSite]]] = {}
        for site in sites:
            self.by_field.setdefault(site.field, {}).setdefault(site.before, []).append(site)
        self.tool_fields = [(name, tool_path(name)) for name in self.by_field
                            if name is not None and name.startswith("tools")]

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        moved: list[str] = []
        tools = body.get("tools")
        if self.tool_fields and isinstance(tools, list):
            tools = self._cut_tools(tools, moved)
        if "messages" in body:
            messages = body["messages"]
            new = list(messages)
            for i, message in enumerate(messages):
                content = _text(message)
                if content is None:
                    continue
                cut = self._cut(f"messages[{i}].content", content, moved)
                if cut is not content:
                    new[i] = {**message, "content": cut}
            if not moved:
                return body
            last = new[-1]
            new[-1] = {**last, "content": (_text(last) or "") + "\n" + " ".join(moved)}
            out = {**body, "messages": new}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                prompt = self._cut("prompt", prompt, moved)
            if not moved:
                return body
            out = {**body, "prompt": prompt + "\n" + " ".join(moved)} if isinstance(prompt, str) else dict(body)
        if tools is not body.get("tools"):
            out["tools"] = tools
        return out

    def text(self, text: str) -> str:
        """A rendered prompt (a request log's text): every site, found by its anchors anywhere in the text."""
        moved: list[str] = []
        for name in self.by_field:
            text = self._cut(name, text, moved)
        return text + "\n" + " ".join(moved) if moved else text

    def _cut_tools(self, tools: list, moved: list[str]) -> list:
        for name, path in self.tool_fields:
            value = _at(tools, path)
            if isinstance(value, str):
                cut = self._cut(name, value, moved)
                if cut is not value:
                    tools = _replaced(tools, path, cut)
        return tools

    def _cut(self, name: str | None, content: str, moved: list[str]) -> str:
        for sites in self.by_field.get(name, {}).values():
            best = None
            for site in sites:
                cut = site.cut(content)
                if cut is not None and (best is None or len(cut[1]) < len(best[1])):
                    best = cut
            if best is not None:
                content, span = best
                moved.append(span.strip())
        return content


_STEP = re.compile(r"\[(\d+)\]|\.([A-Za-z_][\w-]*)")


def tool_path(name: str) -> list[int | str]:
    """``tools[0].function.description`` -> [0, "function", "description"] (the steps below the tools list)."""
    return [int(i) if i else key for i, key in _STEP.findall(name[len("tools"):])]


def _at(value: Any, path: list[int | str]) -> Any:
    for step in path:
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            value = value[step]
        elif isinstance(step, str) and isinstance(value, dict) and step in value:
            value = value[step]
        else:
            return None
    return value


def _replaced(value: Any, path: list[int | str], new: Any) -> Any:
    """A copy of ``value`` with ``new`` at ``path`` (only the containers on the path are copied)."""
    if not path:
        return new
    step, rest = path[0], path[1:]
    if isinstance(value, list):
        return [*value[:step], _replaced(value[step], rest, new), *value[step + 1 :]]
    return {**value, step: _replaced(value[step], rest, new)}


class OneOrder:
    """Tools, the keys of every JSON object, and the moved few-shot examples and documents (``examples``,
    ``documents``: their keys) each in the order first seen."""

    def __init__(self, examples: frozenset[str] = frozenset(), documents: frozenset[str] = frozenset(),
                 tools: SharedTools | None = None) -> None:
        self.examples = examples
        self.documents = documents
        self._tools_json = (tools or SharedTools(limit=0)).json  # the log's tools lists know their JSON
        self._item_rank: dict[str, int] = {}
        self._tool_rank: dict[str, int] = {}
        self._key_rank: dict[str, dict[str, int]] = {}
        # Tools lists as sent -> as ordered (None: unchanged). Valid for good: every name and key of a list has its
        # rank once the list was seen, and ranks never change. Logs repeat few distinct lists.
        self._tools_memo: dict[str, list | None] = {}

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        out = body
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            sent = self._tools_json(tools)
            if sent not in self._tools_memo:
                ordered = [self._keys(t, "tools[]") for t in sorted(tools, key=self._rank)]
                self._tools_memo[sent] = None if json.dumps(ordered) == sent else ordered
            ordered = self._tools_memo[sent]
            if ordered is not None:
                out = {**out, "tools": ordered}
        messages = body.get("messages")
        if isinstance(messages, list):
            new = list(messages)
            for i, m in enumerate(messages):
                content = _text(m)
                if content is None or not content.lstrip().startswith(("{", "[")):
                    continue
                try:
                    value = json.loads(content)
                except ValueError:
                    continue
                again = json.dumps(self._keys(value, f"messages[{i}]"), ensure_ascii=False)
                if again != json.dumps(value, ensure_ascii=False):
                    new[i] = {**m, "content": again}
            if self.examples:
                self._order_examples(new)
            if self.documents:
                self._order_documents(new)
            if new != messages:
                out = {**out, "messages": new}
        return out

    def _item(self, key: str) -> int:
        return self._item_rank.setdefault(key, len(self._item_rank))

    def _order_examples(self, messages: list) -> None:
        first, keys = example_pairs(messages)
        perm = reorder(keys, self.examples, self._item)
        if perm is not None:
            pairs = [messages[first + 2 * j : first + 2 * j + 2] for j in perm]
            messages[first : first + 2 * len(perm)] = [m for pair in pairs for m in pair]

    def _order_documents(self, messages: list) -> None:
        for i, m in enumerate(messages):
            content = _text(m)
            items = documents(content) if content else []
            if items:
                perm = reorder(document_keys(content, items), self.documents, self._item)
                if perm is not None:
                    messages[i] = {**m, "content": reorder_documents(content, items, perm)}

    def _rank(self, tool: Any) -> int:
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = json.dumps(fn.get("name") if isinstance(fn, dict) else tool, sort_keys=True)
        return self._tool_rank.setdefault(name, len(self._tool_rank))

    def _keys(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            rank = self._key_rank.setdefault(path, {})
            for key in value:
                rank.setdefault(key, len(rank))
            return {k: self._keys(value[k], f"{path}.{k}") for k in sorted(value, key=rank.__getitem__)}
        if isinstance(value, list):
            return [self._keys(v, f"{path}[]") for v in value]
        return value


class OneSpelling:
    """Each message as first spelt: later copies that differ only in whitespace or a dropped reasoning block get
    the first copy's text, as a client that kept the history verbatim would send."""

    def __init__(self) -> None:
        self._first: dict[str, str] = {}

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return body
        new = list(messages)
        changed = False
        for i, m in enumerate(messages):
            content = _text(m)
            if not content:
                continue
            first = self._first.setdefault(normalized(content), content)
            if first != content:
                new[i] = {**m, "content": first}
                changed = True
        return {**body, "messages": new} if changed else body


class OneSystemPrompt:
    """One system prompt per conversation (named by its first message after it): every request gets what its first
    request sent. ``heads`` (a request log's rendered text): the template's text before the first message."""

    def __init__(self, conversations: frozenset[str] = frozenset(), heads: dict[str, str] | None = None) -> None:
        self.conversations = conversations
        self.heads = sorted((heads or {}).items(), key=lambda kv: -len(kv[0]))  # the longest head that matches
        self._first: dict[str, Any] = {}

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not self.conversations:
            return body
        system, first = system_message(messages)
        if first >= len(messages):
            return body
        key = conversation_key(messages[first])
        if key not in self.conversations:
            return body
        pinned = self._first.setdefault(key, None if system is None else messages[0])
        if (pinned is None) == (system is None):
            return body
        return {**body, "messages": messages[1:] if pinned is None else [pinned, *messages]}

    def text(self, text: str) -> str:
        for head, first in self.heads:
            if text.startswith(head):
                return first + text[len(head):]
        return text


def _text(message: Any) -> str | None:
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return message["content"]
    return None
