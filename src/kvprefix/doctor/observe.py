"""Pass 1, observe: reads the log once; renders and hashes each request as is (and as ``text`` for a request log
with prompts) and in the first request's namespace (``one namespace``), and compares it with the earlier request it
shares most with (``findings``)."""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

from kvprefix.doctor.chains import Variant, Variants
from kvprefix.doctor.divergence import Rendered
from kvprefix.doctor.findings import Comparer, Findings
from kvprefix.doctor.hashing import Space, space_of
from kvprefix.doctor.source import Log
from kvprefix.logs import AdapterNames, LogEntry, LogError
from kvprefix.sim.trace import coarsen, coarsening_factor


@dataclass
class Requests:
    """Per request, in log order, what the replays and the examples need."""

    lines: array = field(default_factory=lambda: array("q"))
    arrival: list[float | None] = field(default_factory=list)
    prefill: list[float | None] = field(default_factory=list)
    replica: list[str] = field(default_factory=list)
    space_of: array = field(default_factory=lambda: array("q"))  # its index in ``space_names``
    space_names: dict[Space, int] = field(default_factory=dict)
    namespaces: Counter[Space] = field(default_factory=Counter)  # requests per space
    miss_reasons: Counter[str] = field(default_factory=Counter)
    adapters: AdapterNames = field(default_factory=AdapterNames)  # the first request's model is the base model

    def add(self, e: LogEntry) -> Space:
        """Adds the request; its space."""
        space = space_of(e, self.adapters)
        self.lines.append(e.line)
        self.arrival.append(e.timestamp)
        self.prefill.append(e.prefill_s)
        self.replica.append(e.replica)
        self.namespaces[space] += 1
        self.space_of.append(self.space_names.setdefault(space, len(self.space_names)))
        if e.miss_reason:
            self.miss_reasons[e.miss_reason] += 1
        return space


@dataclass
class Observation:
    """What the pass found, for the passes after it."""

    variants: Variants
    requests: Requests = field(default_factory=Requests)
    findings: Findings = field(default_factory=Findings)
    text_ok: bool = True  # every record of a request log has its text
    shared_namespace: Space | None = None  # the first request's


def observe(log: Log) -> Observation:
    """Pass 1 over ``log`` (module docstring)."""
    obs = Observation(Variants(log.block_size))
    base = obs.variants.get_or_add("as is")
    comparer = Comparer(log.block_size, obs.variants.tree, log.tools, obs.findings, log.renderer.head_tokens)
    for chunk in log.chunks("reading"):
        for e, ahead in zip(chunk, _render_ahead(log, chunk, obs.text_ok), strict=True):
            _observe(log, obs, comparer, base, e, ahead)
    if not obs.requests.lines:
        raise LogError(log.path, None, "the log is empty")
    return obs


def _render_ahead(log: Log, chunk: list[LogEntry], text_ok: bool) -> list[Rendered | None]:
    """Each entry's rendering, done in a batch where the pass will need it (a body; a request log's text while
    every record so far has one), else None."""
    wanted = chunk
    if not log.bodies:
        stop = next((k for k, e in enumerate(chunk) if e.text is None), len(chunk))
        wanted = chunk[:stop] if text_ok else []
    rendered = log.renderer.entries(wanted) if wanted else []
    return rendered + [None] * (len(chunk) - len(rendered))


def _observe(log: Log, obs: Observation, comparer: Comparer, base: Variant, e: LogEntry,
             ahead: Rendered | None) -> None:
    i = len(obs.requests.lines)
    space = obs.requests.add(e)
    rendered = None
    if e.block_hashes is not None:
        base.add(_logged(log, e), e.prompt_tokens)
        if e.text is None:
            obs.text_ok = False
        elif obs.text_ok:
            rendered = ahead if ahead is not None else log.renderer.entry(e)
            if len(rendered.token_ids) != e.prompt_tokens:
                raise LogError(log.path, e.line, f"the prompt text tokenizes to {len(rendered.token_ids)} tokens, "
                                                 f"the log says {e.prompt_tokens}: give --model the checkpoint the "
                                                 f"server ran")
            text = obs.variants.get_or_add("text")
            text.add(log.hashing(rendered, space), e.prompt_tokens)
            _one_namespace(log, obs, i, space, rendered, text)
    else:
        rendered = ahead if ahead is not None else log.renderer.entry(e)
        base.add(log.hashing(rendered, space), len(rendered.token_ids))
        _one_namespace(log, obs, i, space, rendered, base)
    if rendered is not None:
        comparer.compare(i, e, rendered, base)


def _one_namespace(log: Log, obs: Observation, i: int, space: Space, rendered: Rendered, same: Variant) -> None:
    """The namespace fix: every request in the first request's namespace (requests already there are as in
    ``same``)."""
    if obs.shared_namespace is None:
        obs.shared_namespace = space
    shared = obs.variants.get_or_add("one namespace")
    if space == obs.shared_namespace:
        shared.copy(same, i)
    else:
        shared.add(log.hashing(rendered, obs.shared_namespace), len(rendered.token_ids))


def _logged(log: Log, e: LogEntry) -> list:
    """The logged hashes at the doctor's block size."""
    factor = coarsening_factor(log.path, e.source_block_size, log.block_size, e.line)
    return coarsen(e.block_hashes, factor, e.prompt_tokens // log.block_size)
