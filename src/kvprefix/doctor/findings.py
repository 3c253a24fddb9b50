"""Comparing each request with the earlier request it shares most with, and what the comparisons found: per
cause, its first example and how many pairs show it; the volatile sites, items and template heads the fixes
learn; where requests part."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from kvprefix.doctor.chains import BlockTree, Variant
from kvprefix.doctor.divergence import Divergence, Rendered, VolatileSite, classify, common_tokens
from kvprefix.logs import LogEntry, SharedTools

_RING = 8  # recent requests a request is compared with when no earlier block of it is known
_RECENT = 1024  # renderings kept, so the request that first had a block is usually still at hand
MAX_SITES = 32
_MAX_LEARNED = 4096  # items, conversations and template heads a fix learns from the pairs


@dataclass
class Findings:
    examples: dict[str, Divergence] = field(default_factory=dict)  # the first pair of each kind
    pairs: Counter[str] = field(default_factory=Counter)
    sites: Counter[VolatileSite] = field(default_factory=Counter)
    learned: dict[str, set] = field(default_factory=lambda: {"examples": set(), "documents": set(), "system": set()})
    heads: dict[str, str] = field(default_factory=dict)  # request log: a template head -> the one first seen there
    short_suspect: bool = False  # some pair shares less than a block
    positions: list[int] = field(default_factory=list)  # first differing token, per compared request

    def add(self, d: Divergence) -> None:
        self.pairs[d.kind] += 1
        self.examples.setdefault(d.kind, d)
        if d.site is not None and (d.site in self.sites or len(self.sites) < MAX_SITES):
            self.sites[d.site] += 1
        if d.learned is not None:
            what, value = d.learned
            if what == "head":
                new, old = value
                if new not in self.heads and len(self.heads) < MAX_SITES:
                    self.heads[new] = self.heads.get(old, old)
            elif len(self.learned[what]) < _MAX_LEARNED:
                self.learned[what].update(value if isinstance(value, frozenset) else (value,))


@dataclass
class _Seen:
    index: int
    line: int
    rendered: Rendered
    body: dict | None


class Comparer:
    """Finds, for each request in turn, the earlier one it shares most with and why they part, into ``findings``:
    the request that first had this one's last block seen before, else the closest of the last few."""

    def __init__(self, block_size: int, tree: BlockTree, tools: SharedTools, findings: Findings):
        self.block_size = block_size
        self.tree = tree
        self.tools = tools
        self.findings = findings
        self.ring: deque[_Seen] = deque(maxlen=_RING)
        self.recent: OrderedDict[int, _Seen] = OrderedDict()
        self.parted_at: dict[int, int] = {}  # block -> the latest request whose shared prefix ended there

    def compare(self, i: int, e: LogEntry, rendered: Rendered, base: Variant) -> None:
        best, best_t = self._nearest(i, rendered, base)
        me = _Seen(i, e.line, rendered, e.body)
        self.ring.append(me)
        self.recent[i] = me
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        if best is None or best_t >= len(rendered.token_ids):
            return
        self.findings.positions.append(best_t)
        if max(2, self.block_size // 2) <= best_t < self.block_size:
            self.findings.short_suspect = True
        chat = e.body is not None and "messages" in e.body or e.body is None and len(rendered.fields) > 1
        last = rendered.fields[-1][0] if chat and rendered.fields else None
        d = classify(rendered, e.body, e.line, best.rendered, best.body, best.line, lambda name: name == last,
                     self._tools_json(e.body), self._tools_json(best.body))
        if d is not None:
            self.findings.add(d)

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
