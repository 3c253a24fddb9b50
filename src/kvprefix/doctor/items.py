"""Items whose order means nothing: few-shot examples (user/assistant pairs before the conversation) and documents
inside one message. ``moved`` finds the same items in another order; ``reorder`` puts them back in one order."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

_TAGGED = re.compile(r"<(document|doc|source|context)\b[^>]*>(.*?)</\1\s*>", re.S | re.I)
_NUMBERED = re.compile(r"^[ \t]*(?:\[\d+\]|\(\d+\)|\d+[.)]|(?:document|doc|source)\s*#?\d+\s*[:.])[ \t]*",
                       re.M | re.I)
_BLANK = re.compile(r"\n[ \t]*\n\s*")
_DIGITS = re.compile(r"\d+")

# One item: (start, end) in the content, and (key_start, key_end) of the part that names it (without tag or number).
# A label outside the key stays when items move, unless labels are not numbers in order (then it moves too).
Item = tuple[int, int, int, int]


def documents(content: str) -> list[Item]:
    """The documents of a message's content, in the first layout that has at least two: <document>...</document>
    (also <doc>, <source>, <context>), numbered ([1], 1., (1), Document 1:), paragraphs between blank lines."""
    tagged = [(m.start(), m.end(), m.start(2), m.end(2)) for m in _TAGGED.finditer(content)]
    if len(tagged) >= 2:
        return tagged
    marks = list(_NUMBERED.finditer(content))
    if len(marks) >= 2:
        out = []
        for k, m in enumerate(marks):
            end = marks[k + 1].start() if k + 1 < len(marks) else len(content)
            if k + 1 == len(marks):  # the last one ends at a blank line: what follows is the question
                blank = _BLANK.search(content, m.end())
                end = blank.start() if blank else end
            body_end = m.end() + len(content[m.end():end].rstrip())
            out.append((m.start(), body_end, m.end(), body_end))
        return out
    out, start = [], 0
    for sep in _BLANK.finditer(content):
        out.append((start, sep.start(), start, sep.start()))
        start = sep.end()
    if out and start < len(content):
        out.append((start, len(content), start, len(content)))
    return out if len(out) >= 2 else []


def document_keys(content: str, items: list[Item]) -> list[str]:
    return [content[ks:ke].strip() for _, _, ks, ke in items]


def example_pairs(messages: Sequence[Any]) -> tuple[int, list[str]]:
    """(index of the first message of the run, one key per pair): the run of user/assistant message pairs that
    follows the system message, as few-shot examples are sent."""
    first = 1 if messages and _role(messages[0]) in ("system", "developer") else 0
    keys, i = [], first
    while i + 1 < len(messages) and _role(messages[i]) == "user" and _role(messages[i + 1]) == "assistant":
        keys.append(json.dumps([_content(messages[i]), _content(messages[i + 1])], ensure_ascii=False))
        i += 2
    return first, keys


def moved(new: Sequence[str], old: Sequence[str]) -> set[str] | None:
    """The items that moved, where ``new`` holds from its first difference with ``old`` the same items in another
    order (the shortest run of at least two that holds the same items in both); None where it does not."""
    k = first_difference(new, old)
    if k is None:
        return None
    diff: Counter[str] = Counter()
    for m in range(k, min(len(new), len(old))):
        diff[new[m]] += 1
        diff[old[m]] -= 1
        if not any(diff.values()):
            return set(new[k : m + 1])
    return None


def first_difference(new: Sequence[str], old: Sequence[str]) -> int | None:
    return next((j for j, (a, b) in enumerate(zip(new, old, strict=False)) if a != b), None)


def reorder(keys: Sequence[str], known: set[str], rank: Callable[[str], int]) -> list[int] | None:
    """A permutation of positions that puts the known items in rank order among the positions they hold (others
    stay); None where they are in order already."""
    slots = [j for j, key in enumerate(keys) if key in known]
    if len(slots) < 2:
        return None
    ranks = {j: rank(keys[j]) for j in slots}  # in position order: a key seen for the first time ranks next
    ordered = sorted(slots, key=ranks.__getitem__)
    if ordered == slots:
        return None
    perm = list(range(len(keys)))
    for slot, j in zip(slots, ordered, strict=True):
        perm[slot] = j
    return perm


def reorder_documents(content: str, items: list[Item], perm: list[int]) -> str:
    """The content with the documents at position p taken from ``perm[p]``; numbers in order (``[1]``,
    ``<document index="1">``) stay where they are, other labels move with their document."""
    heads = [content[s:ks] for s, _, ks, _ in items]
    tails = [content[ke:e] for _, e, _, ke in items]
    positional = _in_order(heads) and _in_order(tails)
    out, cursor = [], 0
    for p, (s, e, _, _) in enumerate(items):
        src = perm[p]
        _, _, ks, ke = items[src]
        out.append(content[cursor:s])
        label = p if positional else src
        out.append(heads[label] + content[ks:ke] + tails[label])
        cursor = e
    out.append(content[cursor:])
    return "".join(out)


def _in_order(labels: list[str]) -> bool:
    """Labels that differ only in numbers that count up (or do not differ): numbering by position."""
    if len({_DIGITS.sub("#", t) for t in labels}) != 1:
        return False
    numbers = [tuple(int(d) for d in _DIGITS.findall(t)) for t in labels]
    return numbers == sorted(numbers)


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else None
