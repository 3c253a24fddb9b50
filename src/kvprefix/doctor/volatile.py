"""Volatile spans: where two renderings part and later meet again, the parts between (any length, any number);
where they never meet again, the part up to a line that other requests carry (``Lines``). And a span's site, the
text either side of it, by which the fix finds the span again in every request (``VolatileSite``)."""

from __future__ import annotations

import dataclasses
import re

# Two renderings meet again where they agree for MIN_AGREEMENT characters of content (the template's closing after
# the last message does not count). Windows of WINDOW characters taken every MIN_AGREEMENT - WINDOW characters
# find where: an agreement that long holds one. The search looks MAX_SEARCH characters past where they part.
MIN_AGREEMENT, WINDOW, MAX_SEARCH = 48, 16, 4096
_STRIDE = MIN_AGREEMENT - WINDOW
MAX_SPANS = 8  # spans learned from one pair
ANCHOR = 24  # characters either side of a span that find it again
_OCCURRENCES = 4  # places a window or an anchor is tried at
_LOOKED_AT = 128  # characters of a span whose look names what it holds
_MAX_LINES = 64  # line starts of one request put in, or looked up in, ``Lines``

# What a span looks like, first match first (a timestamp's date and time are not named again).
_NAMES = {"uuid": "a uuid", "timestamp": "a timestamp", "date": "a date", "email": "an e-mail address",
          "request_id": "a request id", "time": "a time", "hex_id": "a hex id", "counter": "a counter"}
_LOOKS_LIKE = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in (
    ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    ("timestamp", r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2})?\S*"),
    ("date", r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}"),
    ("email", r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"),
    ("request_id", r"(?:req|request|id)[-_:#]?[0-9a-z]{4,}"),
    ("time", r"\d{1,2}:\d{2}(?::\d{2})?"),
    ("hex_id", r"\b[0-9a-f]{12,}\b"),
    ("counter", r"^\W*\d+\W*$"),
)), re.I)

# A part of both renderings: (start, end) in the new one, (start, end) in the other.
Part = tuple[int, int, int, int]


def common_prefix(a, b, i: int = 0, j: int = 0) -> int:
    """Length of the common prefix of ``a[i:]`` and ``b[j:]`` (str or bytes): galloping, then bisection, on slice
    comparisons."""
    n = min(len(a) - i, len(b) - j)
    lo, step = 0, 64  # a[i:i + lo] == b[j:j + lo]
    while lo + step < n and a[i + lo : i + lo + step] == b[j + lo : j + lo + step]:
        lo += step
        step *= 2
    hi = min(n, lo + step)  # the difference, if any, is in a[i + lo:i + hi]
    if a[i + lo : i + hi] == b[j + lo : j + hi]:
        return max(hi, 0)
    hi -= 1  # a[i:i + hi + 1] != b[j:j + hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i + lo : i + mid] == b[j + lo : j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def looks_like(span: str) -> str:
    """What the span holds, as far as its look says (its first characters): 'a request id and an
    e-mail address', else 'a value'."""
    names = list(dict.fromkeys(_NAMES[m.lastgroup] for m in _LOOKS_LIKE.finditer(span[:_LOOKED_AT])))
    if not names:
        return "a value"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def word_start(text: str, q: int, floor: int) -> int:
    while q > floor and not text[q - 1].isspace():
        q -= 1
    return q


def meeting(new: str, old: str, q: int, q_old: int, stop: int) -> tuple[int, int, int] | None:
    """Where ``new`` (from ``q``) and ``old`` (from ``q_old``) first agree again for MIN_AGREEMENT characters before
    ``stop`` in ``new``: (there in new, there in old, characters they agree for); None where they do not."""
    last = min(stop - WINDOW + 1, q + MAX_SEARCH)
    old_end = min(len(old), q_old + 2 * MAX_SEARCH)
    shift = q_old - q
    for k in range(q, last, _STRIDE):
        window = new[k : k + WINDOW]
        j = k + shift  # first where a value of the same length would put it (repetitive text matches anywhere)
        if old[j : j + WINDOW] != window:
            j = old.find(window, q_old, old_end)
        for _ in range(_OCCURRENCES):
            if j < 0:
                break
            i, jj = k, j
            while i > q and jj > q_old and new[i - 1] == old[jj - 1]:
                i, jj = i - 1, jj - 1
            if i + MIN_AGREEMENT <= stop and new[i : i + MIN_AGREEMENT] == old[jj : jj + MIN_AGREEMENT]:
                return i, jj, min(common_prefix(new, old, i, jj), stop - i)
            j = old.find(window, j + 1, old_end)
    return None


def parts(new: str, old: str, p: int, stop: int, carried: Carried | None = None,
          carried_old: Carried | None = None) -> list[Part]:
    """The parts where ``new`` and ``old`` (equal up to ``p``) differ and meet again before ``stop`` (each from the
    start of the word that changed to the end of the word where they meet, and the whitespace after it); where they
    never meet again, the part up to the first line of its field that other requests carry (``carried``), if
    any. A part where either holds a line other requests carry (besides ``old`` for its own) ends the search: that
    is another prompt, not a value of its own."""
    out: list[Part] = []
    q, q_old, floor = p, p, 0
    while len(out) < MAX_SPANS and q < stop and q_old < len(old):
        s = word_start(new, q, floor)
        s_old = q_old - (q - s)
        if carried is not None and carried.recurs(s, 0) or carried_old is not None and carried_old.recurs(s_old, 1):
            break
        met = meeting(new, old, q, q_old, stop)
        if met is None:
            end = _carried_line(new, q, carried) if carried is not None else None
            if end is not None:
                nl = old.find("\n", q_old)
                out.append((s, end, s_old, nl + 1 if nl >= 0 else len(old)))
            break
        i, j, agree = met
        if i == s or j == s_old:  # one has nothing there: an insertion, not a value that changed
            break
        n = 0
        while n < agree and not new[i + n].isspace():  # to the end of the word, so the cut leaves clean text
            n += 1
        while n < agree and new[i + n].isspace():
            n += 1
        out.append((s, i + n, s_old, j + n))
        q, q_old, floor = i + agree, j + agree, i + n  # they part again there, unless that is ``stop``
    return out


def _carried_line(text: str, q: int, carried: Carried) -> int | None:
    """The first line start after ``q``, in the field ``q`` is in, whose line other requests carry, where the line
    ``q`` is in is carried by none (a value of its own, not another request's line; too short to tell: None)."""
    field = carried.field_at(q)
    key = carried.line_key(q, field)
    if key == 0 or key in carried.seen:
        return None
    stop = field[1]
    k = text.find("\n", q, stop - MIN_AGREEMENT)
    for _ in range(_MAX_LINES):
        if k < 0:
            return None
        if hash(text[k + 1 : k + 1 + MIN_AGREEMENT]) in carried.seen:
            end = k + 1
            while end < stop and text[end].isspace():  # blank lines go with the span, as after a meeting
                end += 1
            return end
        k = text.find("\n", k + 1, stop - MIN_AGREEMENT)
    return None


class Carried:
    """Whether other requests carry the lines of one rendering (``Lines``): a line is known by the hash of its
    first MIN_AGREEMENT characters, where they fit in its field."""

    def __init__(self, text: str, fields: list[tuple[str, int, int]], seen: dict[int, int]):
        self.text, self.fields, self.seen = text, fields, seen

    def field_at(self, k: int) -> tuple[int, int] | None:
        for _, start, end in self.fields:
            if start <= k < end:
                return start, end
        return None

    def line_key(self, k: int, field: tuple[int, int] | None = None) -> int:
        """The key of the line ``k`` is in (from its field's start where the line starts before), where its
        window fits in the field and reaches ``k``; else 0."""
        field = field or self.field_at(k)
        if field is None:
            return 0
        line = self.text.rfind("\n", field[0], k) + 1 or field[0]
        if k >= line + MIN_AGREEMENT or line + MIN_AGREEMENT > field[1]:
            return 0
        return hash(self.text[line : line + MIN_AGREEMENT])

    def recurs(self, k: int, besides: int) -> bool:
        """Whether more than ``besides`` earlier requests carry the line ``k`` is in, read from its start through
        ``k`` (unknown: False)."""
        key = self.line_key(k)
        return key != 0 and self.seen.get(key, 0) > besides


class Lines:
    """The lines of content earlier requests carry: each line start's next MIN_AGREEMENT characters, hashed, and
    how many requests had them (a bounded map)."""

    def __init__(self, limit: int = 1 << 18):
        self.limit = limit
        self._seen: dict[int, int] = {}

    def carried(self, text: str, fields: list[tuple[str, int, int]]) -> Carried:
        return Carried(text, fields, self._seen)

    def count(self, key: int) -> int:
        """How many requests carry the line of key ``key`` (``Carried.line_key``)."""
        return self._seen.get(key, 0)

    def add(self, text: str, fields: list[tuple[str, int, int]]) -> None:
        if len(self._seen) >= self.limit:
            return
        seen, n = self._seen, 0
        for _, start, end in fields:
            k = start
            while 0 <= k and k + MIN_AGREEMENT <= end and n < _MAX_LINES:
                h = hash(text[k : k + MIN_AGREEMENT])
                seen[h] = seen.get(h, 0) + 1
                n += 1
                k = text.find("\n", k, end - MIN_AGREEMENT)
                k = k + 1 if k >= 0 else -1


@dataclasses.dataclass(frozen=True)
class VolatileSite:
    """Where a volatile span sits: in field ``field``, after ``before`` and up to ``after`` ("" either: the start,
    the end of the field), at most ``longest`` characters long."""

    field: str | None
    before: str
    after: str
    # Not part of the site (sites that differ only in these are one): how long a span it cuts, and the hash of the
    # value it was found with.
    longest: int = dataclasses.field(default=0, compare=False)
    value: int = dataclasses.field(default=0, compare=False)
    line: int = dataclasses.field(default=0, compare=False)  # ``Carried.line_key`` of where it was found

    def cut(self, content: str) -> tuple[str, str] | None:
        """(content without the span, the span), or None where the site is not in ``content``."""
        k = content.find(self.before) if self.before else 0
        for _ in range(_OCCURRENCES):
            if k < 0:
                return None
            start = k + len(self.before)
            if self.after:
                end = content.find(self.after, start + 1, start + self.longest + len(self.after))
            else:
                end = len(content) if len(content) - start <= self.longest else -1
            if end > start:
                return content[:start] + content[end:], content[start:end]
            if not self.before:
                return None
            k = content.find(self.before, k + 1)
        return None


def site(field: str | None, content: str, s: int, e: int, line: int = 0) -> VolatileSite:
    """The site of ``content[s:e]``: the text either side of it, and room for the same value a good deal longer."""
    return VolatileSite(field, content[max(0, s - ANCHOR) : s], content[e : e + ANCHOR], 4 * (e - s) + 256,
                        hash(content[s:e].strip()), line)
