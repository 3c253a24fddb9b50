"""Comparing each request with the earlier request it shares most with, and what the comparisons found: per
cause, its first example and how many pairs show it; the volatile sites, items and template heads the fixes
learn; where requests part."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvprefix.doctor.chains import BlockTree, Variant
from kvprefix.doctor.divergence import Divergence, Rendered, classify, common_tokens, conversation_key, system_message
from kvprefix.doctor.volatile import Lines, VolatileSite
from kvprefix.logs import LogEntry, SharedTools

_RING = 8  # recent requests a request is compared with when no earlier block of it is known
_RECENT = 1024  # renderings kept, so the request that first had a block is usually still at hand
MAX_SITES = 32
_MAX_LEARNED = 4096  # items, conversations and template heads a fix learns from the pairs
_MAX_CONVERSATIONS = 1 << 16  # conversations whose system message (or none) is remembered
_VALUES, _VALUES_TOLD = 64, 4  # values kept per volatile site; how many tell whether they repeat


@dataclass
class Findings:
    examples: dict[str, Divergence] = field(default_factory=dict)  # the first pair of each kind
    pairs: Counter[str] = field(default_factory=Counter)
    sites: Counter[VolatileSite] = field(default_factory=Counter)
    learned: dict[str, set] = field(default_factory=lambda: {"examples": set(), "documents": set(), "system": set()})
    heads: dict[str, str] = field(default_factory=dict)  # request log: a template head -> the one first seen there
    # Requests whose shared part ends well inside a block that holds none of their content before it (a smaller
    # block would catch it): the requests a smaller block size is credited for.
    short: set[int] = field(default_factory=set)
    _values: dict[VolatileSite, list[int]] = field(default_factory=dict)  # the first values each site was seen with
    lines: Lines = field(default_factory=Lines)  # the lines of content the requests carry
    positions: list[int] = field(default_factory=list)  # first differing token, per compared request

    def add(self, d: Divergence) -> None:
        self.pairs[d.kind] += 1
        self.examples.setdefault(d.kind, d)
        for site in d.sites:
            if site in self.sites or len(self.sites) < MAX_SITES:
                self.sites[site] += 1
                values = self._values.setdefault(site, [])
                if len(values) < _VALUES:
                    values.append(site.value)
        if d.learned is not None:
            what, value = d.learned
            if what == "head":
                new, old = value
                if new not in self.heads and len(self.heads) < MAX_SITES:
                    self.heads[new] = self.heads.get(old, old)
            elif len(self.learned[what]) < _MAX_LEARNED:
                self.learned[what].update(value if isinstance(value, frozenset) else (value,))

    @property
    def short_suspect(self) -> bool:
        """Whether the log's requests share short parts: a quarter of the requests compared, at least (a word two
        requests happen to start with is no shared prefix)."""
        return bool(self.short) and 4 * len(self.short) >= len(self.positions)

    def volatile_sites(self) -> Counter[VolatileSite]:
        """The sites whose values change from request to request: a site whose spans repeat, or whose line other
        requests carry too (each of a few system prompts, parted from another before the same tools), holds
        another prompt, not a volatile value."""
        kept: Counter[VolatileSite] = Counter()
        for site, n in self.sites.items():
            values = self._values[site]
            if (len(values) < _VALUES_TOLD or 2 * len(set(values)) >= len(values)) and self.lines.count(site.line) <= 1:
                kept[site] = n
        return kept


@dataclass
class _Seen:
    index: int
    line: int
    rendered: Rendered
    body: dict | None


class Comparer:
    """Finds, for each request in turn, the earlier one it shares most with and why they part, into ``findings``:
    the request that first had this one's last block seen before, else the closest of the last few."""

    def __init__(self, block_size: int, tree: BlockTree, tools: SharedTools, findings: Findings,
                 head_tokens: Callable[[Rendered], int]):
        self.block_size = block_size
        self.tree = tree
        self.tools = tools
        self.findings = findings
        self.head_tokens = head_tokens  # tokens of the template's text before a rendering's first message
        self.ring: deque[_Seen] = deque(maxlen=_RING)
        self.recent: OrderedDict[int, _Seen] = OrderedDict()
        self.parted_at: dict[int, int] = {}  # block -> the latest request whose shared prefix ended there
        self._systems: dict[int, int] = {}  # conversation -> bit 1: seen without a system message, bit 2: with one

    def compare(self, i: int, e: LogEntry, rendered: Rendered, base: Variant) -> None:
        best, best_t = self._nearest(i, rendered, base)
        me = _Seen(i, e.line, rendered, e.body)
        self.ring.append(me)
        self.recent[i] = me
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        text = rendered.text
        if best is not None and best_t < len(rendered.token_ids):
            self.findings.positions.append(best_t)
            if self._short(rendered, best_t):
                self.findings.short.add(i)
            d = classify(rendered, e.body, e.line, best.rendered, best.body, best.line, self._tools_json(e.body),
                         self._tools_json(best.body), self.findings.lines)
            if d is not None:
                self.findings.add(d)
        if text is not None:
            self.findings.lines.add(text, rendered.fields)
        if e.body is not None:
            self._system_or_not(e.body)

    def _system_or_not(self, body: dict) -> None:
        """Learns a conversation (its first message after the system prompt) sent once with a system message and
        once without, however far apart: the requests in between may each share more with others."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return
        system, first = system_message(messages)
        message = messages[first] if first < len(messages) else None
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return
        key, bit = hash((message.get("role"), message["content"])), 1 if system is None else 2
        seen = self._systems.get(key, 0)
        if seen | bit == 3 != seen:
            self.findings.pairs["template-drift"] += 1
            if len(self.findings.learned["system"]) < _MAX_LEARNED:
                self.findings.learned["system"].add(conversation_key(message))
        if seen | bit != seen and len(self._systems) < _MAX_CONVERSATIONS:
            self._systems[key] = seen | bit

    def _short(self, rendered: Rendered, shared: int) -> bool:
        """Whether the ``shared`` tokens end well inside a block and no full block of them holds content: the
        shared part is short, past the template's own text (completions: none)."""
        bs = self.block_size
        if shared % bs < max(2, bs // 2):
            return False
        head = self.head_tokens(rendered)
        return head < shared and shared // bs * bs <= head

    def _nearest(self, i: int, rendered: Rendered, base: Variant) -> tuple[_Seen | None, int]:
        known, first, parent = base.leaves[i], self.tree.first_request, self.tree.parent
        while known >= 0 and first[known] == i:  # the blocks this request was the first to have
            known = parent[known]
        owner = None
        if known >= 0:  # the latest request that parted at this block, else the first that had it
            owner = self.recent.get(self.parted_at.get(known, -1)) or self.recent.get(first[known])
            self.parted_at[known] = i
        best, best_t = None, -1
        for seen in [owner] if owner is not None else list(self.ring):
            t = common_tokens(rendered, seen.rendered)
            if t > best_t:
                best, best_t = seen, t
        return best, best_t

    def _tools_json(self, body: dict | None) -> str | None:
        """A body's tools as sent (key order kept), as JSON."""
        tools = body.get("tools") if body is not None else None
        return self.tools.json(tools) if isinstance(tools, list) and tools else None
