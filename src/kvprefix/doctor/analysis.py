"""The doctor's analysis: read the log once to render it, hash it and learn where renderings part; render it again
with each fix that applies; replay every rendering through the planner; attribute the lost tokens."""

from __future__ import annotations

import gc
import os
import sys
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvprefix.cache import BlockExtras, BlockHasher, LoraKey
from kvprefix.doctor.chains import BlockTree, Variant
from kvprefix.doctor.divergence import Divergence, Rendered, VolatileSite, classify, common_tokens
from kvprefix.doctor.fixes import MoveVolatileToEnd, OneOrder, OneSpelling, OneSystemPrompt
from kvprefix.doctor.kinds import KINDS
from kvprefix.doctor.readers import BODIES, DoctorInputError, LogEntry, SharedTools, iter_entries, log_format
from kvprefix.doctor.rendering import Renderer
from kvprefix.doctor.replaying import Replayer, Setting, Timing
from kvprefix.sim.trace import TraceError, coarsen, coarsening_factor
from kvprefix.tokenizer import Tokenizer

DEFAULT_BLOCK_SIZE = 16
_RING = 8  # recent requests a request is compared with when no earlier block of it is known
_RECENT = 1024  # renderings kept, so the request that first had a block is usually still at hand
_MAX_SITES = 32
_MAX_LEARNED = 4096  # items, conversations and template heads a fix learns from the pairs
_MAX_CAPACITY_STEPS = 16
_BATCH = 256  # entries rendered together: fewer calls into the template and the tokenizer, little memory


@dataclass
class Options:
    block_size: int | None = None  # default: 16 for bodies, the log's own for a request log
    capacity_tokens: int | None = None  # per replica; None = unbounded
    progress: str = "off"  # "bar" (a terminal), "lines" (a line on stderr every progress_every_s seconds), "off"
    progress_every_s: float = 10.0


@dataclass
class Cause:
    kind: str
    requests: int
    tokens_lost: int
    example: dict[str, Any] | None
    fix: str
    hit_rate_after: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "requests": self.requests, "tokens_lost": self.tokens_lost,
                "example": self.example, "fix": self.fix, "hit_rate_after": self.hit_rate_after}


@dataclass
class Diagnosis:
    log: str
    requests: int
    block_size: int
    capacity_tokens: int | None
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    causes: list[Cause]
    divergence_positions: list[int] = field(default_factory=list)  # first differing token, per request

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "block_size": self.block_size, "hit_rate": self.hit_rate,
                "causes": [c.to_dict() for c in self.causes]}


@dataclass
class _Seen:
    index: int
    line: int
    rendered: Rendered
    body: dict | None


def diagnose(path: str, load_tokenizer: Callable[[], Tokenizer], options: Options | None = None) -> Diagnosis:
    # Without the cyclic collector: what the doctor keeps (arrays, dicts and lists of ids and numbers) holds no
    # cycle, and rendering leaves none behind (a 20,000-body log leaves as many as a 5,000-body one), but every young
    # collection walks the token lists in flight, which cost a sixth of the time. The switch is the process's: one
    # diagnosis at a time (the CLI's case); a host program's other threads run without the collector meanwhile.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Doctor(path, load_tokenizer, options or Options()).run()
    finally:
        if collecting:
            gc.enable()


class _Doctor:
    def __init__(self, path: str, load_tokenizer: Callable[[], Tokenizer], options: Options):
        self.path = path
        self.options = options
        self.fmt = log_format(path)
        self._load_tokenizer = load_tokenizer
        self._renderer: Renderer | None = None
        self.bs = options.block_size or (DEFAULT_BLOCK_SIZE if self.fmt == BODIES else self._logged_block_size())
        if options.capacity_tokens is not None and options.capacity_tokens < self.bs:
            raise ValueError(f"--capacity {options.capacity_tokens} is smaller than one {self.bs}-token block")
        self.tree = BlockTree()
        self.variants: dict[str, Variant] = {}
        self.lines = array("q")
        self.arrival: list[float | None] = []
        self.prefill: list[float | None] = []
        self.replica: list[str] = []
        self.namespaces: Counter[tuple[str, str]] = Counter()  # (namespace salt, adapter) -> requests
        self.space_of = array("q")  # per request, its index in ``space_names``
        self.space_names: dict[tuple[str, str], int] = {}
        self.base_model: str | None = None  # the first request's model; another model names an adapter of it
        self._extras: dict[str, BlockExtras] = {}
        self.miss_reasons: Counter[str] = Counter()
        self.ring: deque[_Seen] = deque(maxlen=_RING)
        self.recent: OrderedDict[int, _Seen] = OrderedDict()
        self.parted_at: dict[int, int] = {}  # block -> the latest request whose shared prefix ended there
        self.examples: dict[str, Divergence] = {}
        self.pairs: Counter[str] = Counter()
        self.sites: Counter[VolatileSite] = Counter()
        self.short_suspect = False
        self.shared_namespace: tuple[str, str] | None = None
        self.learned: dict[str, set] = {"examples": set(), "documents": set(), "system": set()}
        self.heads: dict[str, str] = {}  # request log: a template head -> the one first seen in its place
        self.text_ok = True  # every record of a request log has its text
        self.positions: list[int] = []
        self.tools = SharedTools()  # both passes read the same lists (the tools fix looks its lists up by them)

    # -- reading -------------------------------------------------------------------------------------------------

    def _logged_block_size(self) -> int:
        for entry in iter_entries(self.path, self.fmt):
            return entry.source_block_size or DEFAULT_BLOCK_SIZE
        raise DoctorInputError(f"{self.path}: the log is empty")

    def _variant(self, name: str, block_size: int | None = None) -> Variant:
        if name not in self.variants:
            self.variants[name] = Variant(name, block_size or self.bs, self.tree, 1 << len(self.variants))
        return self.variants[name]

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer.of(self._load_tokenizer(), self.path)
        return self._renderer

    def _entries(self, desc: str) -> Iterator[LogEntry]:
        entries = iter_entries(self.path, self.fmt, self.tools)
        if self.options.progress == "lines":
            return _progress_lines(entries, desc, self._num_lines(), self.path, self.options.progress_every_s)
        if self.options.progress != "bar":
            return entries
        from tqdm import tqdm

        return tqdm(entries, desc=desc, unit="req", total=self._num_lines(), mininterval=0.5, leave=False)

    def _num_lines(self) -> int:
        with open(self.path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))

    def _chunks(self, desc: str) -> Iterator[list[LogEntry]]:
        """The entries, ``_BATCH`` at a time; a bad line ends the entries after the ones before it were given."""
        entries = self._entries(desc)
        while True:
            chunk: list[LogEntry] = []
            error = None
            try:
                for e in entries:
                    chunk.append(e)
                    if len(chunk) == _BATCH:
                        break
            except DoctorInputError as exc:
                error = exc
            if chunk:
                yield chunk
            if error is not None:
                raise error
            if len(chunk) < _BATCH:
                return

    def _batches(self, desc: str) -> Iterator[tuple[LogEntry, Rendered | None]]:
        """The entries, each with its rendering done ahead in a batch where the first pass will need it (a body;
        a request log's text while every record so far has one), else None."""
        for chunk in self._chunks(desc):
            wanted = chunk
            if self.fmt != BODIES:
                stop = next((k for k, e in enumerate(chunk) if e.text is None), len(chunk))
                wanted = chunk[:stop] if self.text_ok else []
            rendered = self.renderer.entries(wanted) if wanted else []
            yield from zip(chunk, rendered + [None] * (len(chunk) - len(rendered)), strict=True)

    def _render(self, entry: LogEntry, ahead: Rendered | None = None) -> Rendered:
        if ahead is not None:
            return ahead
        if entry.body is not None:
            return self.renderer.body(entry.body, entry.line)
        return self.renderer.text(entry.text, entry.add_special_tokens, entry.message_spans)

    def _space(self, e: LogEntry) -> tuple[str, str]:
        """Where the request's blocks live: its namespace salt (tenant, cache salt) and its adapter ("" = the base
        model: the first request's model)."""
        if self.base_model is None:
            self.base_model = e.model
        return e.namespace, "" if e.model == self.base_model else e.model

    def _hashes(self, rendered: Rendered, space: tuple[str, str], hasher: BlockHasher | None = None) -> list[bytes]:
        """As the engine hashes the request: in its namespace, a LoRA adapter in every block's extra keys."""
        salt, adapter = space
        extras = None
        if adapter:
            extras = self._extras.get(adapter) or self._extras.setdefault(adapter, BlockExtras(LoraKey(adapter, "")))
        hasher = hasher or self.renderer.hasher(self.bs)
        return hasher.with_salt(salt).hash_blocks(rendered.token_ids, extras=extras)

    # -- pass 1: as it is -----------------------------------------------------------------------------------------

    def _first_pass(self) -> None:
        base = self._variant("as is")
        for i, (e, ahead) in enumerate(self._batches("reading")):
            self.lines.append(e.line)
            self.arrival.append(e.timestamp)
            self.prefill.append(e.prefill_s)
            self.replica.append(e.replica)
            space = self._space(e)
            self.namespaces[space] += 1
            self.space_of.append(self.space_names.setdefault(space, len(self.space_names)))
            if e.miss_reason:
                self.miss_reasons[e.miss_reason] += 1
            rendered = None
            if e.block_hashes is not None:
                base.add(self._logged(e), e.prompt_tokens)
                if e.text is None:
                    self.text_ok = False
                elif self.text_ok:
                    rendered = self._render(e, ahead)
                    if len(rendered.token_ids) != e.prompt_tokens:
                        raise DoctorInputError(
                            f"{self.path}:{e.line}: the prompt text tokenizes to {len(rendered.token_ids)} tokens, "
                            f"the log says {e.prompt_tokens}: give --model the checkpoint the server ran")
                    text = self._variant("text")
                    text.add(self._hashes(rendered, space), e.prompt_tokens)
                    self._one_namespace(i, space, rendered, text)
            else:
                rendered = self._render(e, ahead)
                n = len(rendered.token_ids)
                base.add(self._hashes(rendered, space), n)
                self._one_namespace(i, space, rendered, base)
            if rendered is not None:
                self._compare(i, e, rendered, base)
        if not self.lines:
            raise DoctorInputError(f"{self.path}: the log is empty")

    def _one_namespace(self, i: int, space: tuple[str, str], rendered: Rendered, same: Variant) -> None:
        """The namespace fix: every request in the first request's namespace (requests already there are as in
        ``same``); ``space``: the request's, as _space gave it."""
        if self.shared_namespace is None:
            self.shared_namespace = space
        shared = self._variant("one namespace")
        if space == self.shared_namespace:
            shared.copy(same, i)
        else:
            shared.add(self._hashes(rendered, self.shared_namespace), len(rendered.token_ids))

    def _logged(self, e: LogEntry) -> list[str]:
        try:
            factor = coarsening_factor(self.path, e.source_block_size, self.bs, e.line)
        except TraceError as exc:
            raise DoctorInputError(str(exc)) from None
        return coarsen(e.block_hashes, factor, e.prompt_tokens // self.bs)

    def _compare(self, i: int, e: LogEntry, rendered: Rendered, base: Variant) -> None:
        """Finds the earlier request this one shares most with, and why it stops sharing there: the request that
        first had this one's last block that was seen before, else the closest of the last few."""
        known, first, parent = base.leaves[i], self.tree.first_request, self.tree.parent
        while known >= 0 and first[known] == i:  # the blocks this request was the first to have
            known = parent[known]
        owner = None
        if known >= 0:  # the latest request that parted at this block, else the first that had it
            owner = self.recent.get(self.parted_at.get(known, -1)) or self.recent.get(self.tree.first_request[known])
            self.parted_at[known] = i
        candidates = [owner] if owner is not None else list(self.ring)
        best, best_t = None, -1
        for seen in candidates:
            t = common_tokens(rendered, seen.rendered)
            if t > best_t:
                best, best_t = seen, t
        me = _Seen(i, e.line, rendered, e.body)
        self.ring.append(me)
        self.recent[i] = me
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        if best is None or best_t >= len(rendered.token_ids):
            return
        self.positions.append(best_t)
        if max(2, self.bs // 2) <= best_t < self.bs:
            self.short_suspect = True
        chat = e.body is not None and "messages" in e.body or e.body is None and len(rendered.fields) > 1
        last = rendered.fields[-1][0] if chat and rendered.fields else None
        d = classify(rendered, e.body, e.line, best.rendered, best.body, best.line, lambda name: name == last,
                     self._tools_json(e.body), self._tools_json(best.body))
        if d is None:
            return
        self.pairs[d.kind] += 1
        self.examples.setdefault(d.kind, d)
        if d.site is not None and (d.site in self.sites or len(self.sites) < _MAX_SITES):
            self.sites[d.site] += 1
        if d.learned is not None:
            what, value = d.learned
            if what == "head":
                new, old = value
                if new not in self.heads and len(self.heads) < _MAX_SITES:
                    self.heads[new] = self.heads.get(old, old)
            elif len(self.learned[what]) < _MAX_LEARNED:
                self.learned[what].update(value if isinstance(value, frozenset) else (value,))

    def _tools_json(self, body: dict | None) -> str | None:
        """A body's tools as sent (key order kept), as JSON."""
        tools = body.get("tools") if body is not None else None
        return self.tools.json(tools) if isinstance(tools, list) and tools else None

    # -- pass 2: with the fixes ------------------------------------------------------------------------------------

    def _fixes(self) -> dict[str, Callable[[], list]]:
        """Per cause, what makes its fixes (each fix keeps state: one set for the cause alone, one for all)."""
        fixes: dict[str, Callable[[], list]] = {}
        if self.sites:
            fixes["volatile-prefix"] = lambda: [MoveVolatileToEnd(self.sites)]
        if self.fmt == BODIES:  # order and spelling are fixed in bodies; a request log has only the text
            if self.pairs["reordered"]:
                examples, docs = frozenset(self.learned["examples"]), frozenset(self.learned["documents"])
                fixes["reordered"] = lambda: [OneOrder(examples, docs, self.tools)]
            if self.pairs["template-drift"]:
                conversations = frozenset(self.learned["system"])
                fixes["template-drift"] = lambda: [OneSpelling(), OneSystemPrompt(conversations)]
        elif self.heads:  # the template's text before the first message, as first seen
            fixes["template-drift"] = lambda: [OneSystemPrompt(heads=self.heads)]
        return fixes

    def _second_pass(self) -> None:
        makers = self._fixes()
        texts = self.fmt != BODIES
        if texts and not self.text_ok:
            makers = {}
        short_bs = max(1, self.bs // 4)
        short = self.short_suspect and short_bs < self.bs and (not texts or self.text_ok)
        if not makers and not short:
            return
        single = {kind: (make(), self._variant(kind)) for kind, make in makers.items()}
        composed = [fix for make in makers.values() for fix in make()]
        ideal = self._variant("all fixed") if makers else None
        short_variant = self._variant("short-prefix", short_bs) if short else None
        short_hasher = self.renderer.hasher(short_bs)
        source = self.variants["text" if texts else "as is"]
        shared = self.variants["one namespace"]
        i = 0
        for chunk in self._chunks("fixing"):
            # The fixes run entry by entry (a fix keeps the first order it saw); their outputs render as a batch.
            jobs: list[LogEntry] = []  # what to render: the entry as is (short-prefix), each distinct fixed input
            plans = []
            for e in chunk:
                short_job = len(jobs) if short_variant is not None else None
                if short_job is not None:
                    jobs.append(e)
                fixed = [self._apply(fixes, e) for fixes, _ in single.values()]
                if ideal is not None:
                    fixed.append(self._apply(composed, e))
                start = len(jobs)
                plans.append((short_job, [self._job(e, f, jobs, start) for f in fixed]))
            rendered = self._render_jobs(jobs)
            for e, (short_job, fixed_jobs) in zip(chunk, plans, strict=True):
                if short_job is not None:
                    r = rendered[short_job]
                    short_variant.add(self._hashes(r, self._space(e), short_hasher), len(r.token_ids))
                for (_, variant), job in zip(single.values(), fixed_jobs, strict=False):
                    if job is None:
                        variant.copy(source, i)
                    else:
                        variant.add(self._hashes(rendered[job], self._space(e)), len(rendered[job].token_ids))
                if ideal is not None:
                    job = fixed_jobs[-1]
                    if job is None:
                        ideal.copy(shared, i)
                    else:
                        ideal.add(self._hashes(rendered[job], self.shared_namespace), len(rendered[job].token_ids))
                i += 1

    @staticmethod
    def _job(e: LogEntry, fixed: Any, jobs: list[LogEntry], start: int) -> int | None:
        """Where ``fixed`` (the entry with some fixes) is in ``jobs``, added if new; None where the fixes changed
        nothing. An input equal to one of this entry's fixed inputs (from ``start``: all fixes together where only
        one of them applied) is rendered once: the renderer is a function of it."""
        if fixed is e.body or fixed is e.text:
            return None
        for k in range(start, len(jobs)):
            if (jobs[k].body if e.body is not None else jobs[k].text) == fixed:
                return k
        jobs.append(replace(e, body=fixed) if e.body is not None else replace(e, text=fixed, message_spans=None))
        return len(jobs) - 1

    def _render_jobs(self, jobs: list[LogEntry]) -> list[Rendered]:
        """In a batch; one by one where the batch fails (the first failure names its line)."""
        rendered = self.renderer.entries(jobs) if jobs else []
        return [r if r is not None else self._render(job) for r, job in zip(rendered, jobs, strict=True)]

    @staticmethod
    def _apply(fixes: list, e: LogEntry) -> Any:
        """The entry's body (or text) with the fixes applied in turn; the same object where none changed it."""
        if e.body is not None:
            body = e.body
            for fix in fixes:
                body = fix.body(body)
            return body
        text = e.text
        for fix in fixes:
            if hasattr(fix, "text"):
                text = fix.text(text)
        return text

    # -- replays and attribution -----------------------------------------------------------------------------------

    def replay_order(self) -> tuple[bool, list[int], list[list[int]]]:
        """Whether every request has an arrival time; the requests in arrival order (else log order); and that
        order split by replica."""
        n = len(self.lines)
        timed = all(t is not None for t in self.arrival)
        order = sorted(range(n), key=self.arrival.__getitem__) if timed else list(range(n))
        by_replica: dict[str, list[int]] = {}
        for i in order:
            by_replica.setdefault(self.replica[i], []).append(i)
        return timed, order, list(by_replica.values())

    def run(self) -> Diagnosis:
        self._first_pass()
        self._second_pass()
        n = len(self.lines)
        timed, order, groups = self.replay_order()
        timing = Timing(self.arrival, self.prefill) if timed else Timing(None, None)
        cap = self.options.capacity_tokens
        cap_blocks = None if cap is None else cap // self.bs
        now_setting = Setting(cap_blocks, len(groups) > 1, timed)
        base = self.variants["as is"]

        replay = Replayer(order, groups, timing).cached_tokens

        now = replay(base, now_setting)
        total = sum(base.tokens)
        causes: list[Cause] = []

        def add(kind: str, variant: Variant, after: array, only_unhit: bool = False, example=None,
                detail: str = "") -> None:
            gains = [a - b for a, b in zip(after, now, strict=True)]
            if only_unhit:
                gains = [g if now[i] == 0 else 0 for i, g in enumerate(gains)]
            lost = sum(gains) if not only_unhit else sum(g for g in gains if g > 0)
            affected = sum(1 for g in gains if g > 0)
            if lost < self.bs or affected == 0:  # less than one block in the whole log is noise, not a cause
                return
            if example is None:
                example = self._replay_example(kind, variant, gains, now, detail)
            causes.append(Cause(kind, affected, int(lost), example, self._fix_text(kind),
                                _ratio(sum(after), sum(variant.tokens))))

        for kind in ("volatile-prefix", "reordered", "template-drift"):
            if kind in self.variants:
                d = self.examples.get(kind)
                add(kind, self.variants[kind], replay(self.variants[kind], now_setting),
                    example=None if d is None else d.to_dict())
        if "short-prefix" in self.variants:
            v = self.variants["short-prefix"]
            add("short-prefix", v, replay(v, now_setting), only_unhit=True,
                detail=f"at {v.block_size}-token blocks")
        if cap_blocks is not None:
            after = replay(base, Setting(None, now_setting.per_replica, timed))
            add("eviction", base, after, detail=self._capacity_needed(base, replay, now_setting, after))
        if len(groups) > 1:
            add("routing", base, replay(base, Setting(cap_blocks, False, timed)))
        if timed:
            add("concurrency", base, replay(base, Setting(cap_blocks, now_setting.per_replica, False)))
        shared = self.variants.get("one namespace")
        if len(self.namespaces) > 1 and shared is not None and len(shared) == n:
            add("namespace", shared, replay(shared, now_setting))
        elif self.miss_reasons["different_salt"]:
            causes.append(Cause("namespace", self.miss_reasons["different_salt"], 0, None,
                                self._fix_text("namespace"), None))
        causes.sort(key=lambda c: -c.tokens_lost)
        ideal = self.variants.get("all fixed") or (shared if shared is not None and len(shared) == n else base)
        best = replay(ideal, Setting(None, False, False))
        unique = [t - c for t, c in zip(ideal.tokens, best, strict=True)]
        if any(u > 0 for u in unique):
            causes.append(Cause("no-sharing", sum(1 for u in unique if u > 0), int(sum(unique)),
                                self._unique_example(unique, ideal), KINDS["no-sharing"][1], None))
        return Diagnosis(os.path.basename(self.path), n, self.bs, cap, int(total), int(sum(now)),
                         _ratio(sum(now), total), causes, self.positions)

    def _capacity_needed(self, base: Variant, replay, setting: Setting, unbounded: array) -> str:
        """The smallest capacity (doubling from --capacity) at which nothing evicted is lost."""
        goal = sum(unbounded)
        blocks = setting.capacity_blocks
        for _ in range(_MAX_CAPACITY_STEPS):
            blocks *= 2
            if blocks >= base.distinct_blocks + base.max_blocks or sum(
                    replay(base, Setting(blocks, setting.per_replica, setting.in_flight))) >= goal:
                return f"a capacity of {blocks * self.bs} tokens per replica keeps it"
        return ""

    def _fix_text(self, kind: str) -> str:
        fix = KINDS[kind][1]
        if kind == "volatile-prefix" and self.sites:
            site = self.sites.most_common(1)[0][0]
            return f"{fix}: in {site.field}, the span after {site.before[-16:]!r}"
        if kind == "namespace" and any(adapter for _, adapter in self.space_names):
            return f"{fix}; adapters never share KV: send a shared prefix to one model (or adapter)"
        return fix

    def _replay_example(self, kind: str, variant: Variant, gains: list[int], now: array, detail: str) -> dict:
        i = max(range(len(gains)), key=gains.__getitem__)
        chain = self.tree.chain(variant.leaves[i])
        first_lost = now[i] // variant.block_size
        other = self.tree.first_request[chain[first_lost]] if first_lost < len(chain) else -1
        other_line = self.lines[other] if other >= 0 and other != i else None
        what = {
            "eviction": "was cached by line {o}, then evicted before this request came",
            "routing": "was cached on replica {r} (line {o}); this request went to replica {me}",
            "concurrency": "was still being computed for line {o} when this request arrived",
            "namespace": "has the same tokens as line {o}, in another namespace ({why})",
            "short-prefix": "shares fewer tokens than one block with earlier requests",
        }[kind].format(o=other_line, r=self.replica[other] if other >= 0 else "?", me=self.replica[i],
                       why=self._namespace_difference(i, other) if kind == "namespace" else "")
        text = f"line {self.lines[i]}: {gains[i]} prompt tokens from token {now[i]} on {what}"
        return {"line": self.lines[i], "other_line": other_line, "token": now[i], "field": None,
                "detail": f"{text}; {detail}" if detail else text, "this": None, "other": None}

    def _namespace_difference(self, i: int, other: int) -> str:
        if other < 0 or not self.space_of:
            return "tenant, cache salt or adapter"
        names = list(self.space_names)
        (salt, adapter), (other_salt, other_adapter) = names[self.space_of[i]], names[self.space_of[other]]
        whats = [] if salt == other_salt else ["another tenant or cache salt"]
        if adapter != other_adapter:
            whats.append(f"model {adapter or self.base_model!r} vs {other_adapter or self.base_model!r}")
        return ", ".join(whats) or "tenant, cache salt or adapter"

    def _unique_example(self, unique: list[int], ideal: Variant) -> dict:
        i = max(range(len(unique)), key=unique.__getitem__)
        return {"line": self.lines[i], "other_line": None, "token": ideal.tokens[i] - unique[i], "field": None,
                "detail": f"line {self.lines[i]}: {unique[i]} of {ideal.tokens[i]} prompt tokens appear in no "
                          f"earlier request, even with every fix", "this": None, "other": None}


def _progress_lines(entries: Iterator[LogEntry], desc: str, lines: int, path: str,
                    every_s: float) -> Iterator[LogEntry]:
    """The entries, with a line on stderr every ``every_s`` seconds saying how far the pass is (for a job whose
    stderr goes to a file or a pipe, where a bar redrawn in place is noise). A short job prints nothing."""
    start = time.monotonic()
    last = start
    for n, e in enumerate(entries, 1):
        if not n & 255:
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                print(f"kvprefix doctor: {os.path.basename(path)}: {desc}: line {e.line} of {lines} "
                      f"({e.line / max(lines, 1):.0%}), {now - start:.0f} s", file=sys.stderr, flush=True)
        yield e


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
