"""Pass 2, fix: reads the log again and renders each request with each fix that applies, alone (one variant per
cause) and all together (``all fixed``, in the first request's namespace), and as it is at a quarter of the
block size (``short-prefix``) where some requests share less than a block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvprefix.cache import BlockHasher
from kvprefix.doctor.chains import Variant
from kvprefix.doctor.divergence import Rendered
from kvprefix.doctor.fixes import MoveVolatileToEnd, OneOrder, OneSpelling, OneSystemPrompt
from kvprefix.doctor.hashing import space_of
from kvprefix.doctor.observe import Observation
from kvprefix.doctor.source import Log
from kvprefix.logs import LogEntry


@dataclass
class _Plan:
    """What the pass makes: per cause its fixes and variant; all fixes and their variant; the short-prefix one."""

    single: dict[str, tuple[list, Variant]]
    composed: list
    ideal: Variant | None
    short: Variant | None
    source: Variant  # the rendering a fix that changed nothing copies
    shared: Variant | None  # ``one namespace``: what ``ideal`` copies
    short_hasher: BlockHasher | None


def fix(log: Log, obs: Observation) -> dict[str, Variant]:
    """The variants made, by name (also added to ``obs.variants``); empty where no fix applies."""
    plan = _plan(log, obs)
    if plan is None:
        return {}
    i = 0
    for chunk in log.chunks("fixing"):
        # The fixes run entry by entry (a fix keeps the first order it saw); their outputs render as a batch.
        jobs: list[LogEntry] = []  # what to render: the entry as is (short-prefix), each distinct fixed input
        plans = [_jobs(plan, e, jobs) for e in chunk]
        rendered = _render_jobs(log, jobs)
        for e, (short_job, fixed_jobs) in zip(chunk, plans, strict=True):
            _add(log, obs, plan, i, e, rendered, short_job, fixed_jobs)
            i += 1
    made = [v for _, v in plan.single.values()] + [v for v in (plan.ideal, plan.short) if v is not None]
    return {v.name: v for v in made}


def _makers(log: Log, obs: Observation) -> dict[str, Callable[[], list]]:
    """Per cause, what makes its fixes (each fix keeps state: one set for the cause alone, one for all)."""
    found = obs.findings
    makers: dict[str, Callable[[], list]] = {}
    sites = found.volatile_sites()
    if sites:
        makers["volatile-prefix"] = lambda: [MoveVolatileToEnd(sites)]
    if log.bodies:  # order and spelling are fixed in bodies; a request log has only the text
        if found.pairs["reordered"]:
            examples, docs = frozenset(found.learned["examples"]), frozenset(found.learned["documents"])
            makers["reordered"] = lambda: [OneOrder(examples, docs, log.tools)]
        if found.pairs["template-drift"]:
            conversations = frozenset(found.learned["system"])
            makers["template-drift"] = lambda: [OneSpelling(), OneSystemPrompt(conversations)]
    elif found.heads:  # the template's text before the first message, as first seen
        makers["template-drift"] = lambda: [OneSystemPrompt(heads=found.heads)]
    return makers


def _plan(log: Log, obs: Observation) -> _Plan | None:
    texts = not log.bodies
    makers = {} if texts and not obs.text_ok else _makers(log, obs)
    short_bs = max(1, log.block_size // 4)
    short = obs.findings.short_suspect and short_bs < log.block_size and (not texts or obs.text_ok)
    if not makers and not short:
        return None
    variants = obs.variants
    single = {kind: (make(), variants.get_or_add(kind)) for kind, make in makers.items()}
    composed = [f for make in makers.values() for f in make()]
    ideal = variants.get_or_add("all fixed") if makers else None
    short_variant = variants.get_or_add("short-prefix", short_bs) if short else None
    return _Plan(single, composed, ideal, short_variant, variants["text" if texts else "as is"],
                 variants.get("one namespace"), log.renderer.hasher(short_bs) if short else None)


def _jobs(plan: _Plan, e: LogEntry, jobs: list[LogEntry]) -> tuple[int | None, list[int | None]]:
    """Adds the entry's renderings to ``jobs``: (its short-prefix job, its job per fixed input, None: unchanged)."""
    short_job = None
    if plan.short is not None:
        short_job = len(jobs)
        jobs.append(e)
    fixed = [_apply(fixes, e) for fixes, _ in plan.single.values()]
    if plan.ideal is not None:
        fixed.append(_apply(plan.composed, e))
    start = len(jobs)
    return short_job, [_job(e, f, jobs, start) for f in fixed]


def _add(log: Log, obs: Observation, plan: _Plan, i: int, e: LogEntry, rendered: list[Rendered],
         short_job: int | None, fixed_jobs: list[int | None]) -> None:
    """Adds request ``i`` to each variant the pass makes."""
    space = space_of(e, obs.requests.adapters)
    if short_job is not None:
        r = rendered[short_job]
        plan.short.add(log.hashing(r, space, plan.short_hasher), len(r.token_ids))
    for (_, variant), job in zip(plan.single.values(), fixed_jobs, strict=False):
        if job is None:
            variant.copy(plan.source, i)
        else:
            variant.add(log.hashing(rendered[job], space), len(rendered[job].token_ids))
    if plan.ideal is not None:
        job = fixed_jobs[-1]
        if job is None:
            plan.ideal.copy(plan.shared, i)
        else:
            plan.ideal.add(log.hashing(rendered[job], obs.shared_namespace), len(rendered[job].token_ids))


def _job(e: LogEntry, fixed: Any, jobs: list[LogEntry], start: int) -> int | None:
    """Where ``fixed`` is in ``jobs``, added if new (equal inputs from ``start`` on render once); None where the
    fixes changed nothing."""
    if fixed is e.body or fixed is e.text:
        return None
    for k in range(start, len(jobs)):
        if (jobs[k].body if e.body is not None else jobs[k].text) == fixed:
            return k
    jobs.append(replace(e, body=fixed) if e.body is not None else replace(e, text=fixed, message_spans=None))
    return len(jobs) - 1


def _render_jobs(log: Log, jobs: list[LogEntry]) -> list[Rendered]:
    """In a batch; one by one where the batch fails (the first failure names its line)."""
    rendered = log.renderer.entries(jobs) if jobs else []
    return [r if r is not None else log.renderer.entry(job) for r, job in zip(rendered, jobs, strict=True)]


def _apply(fixes: list, e: LogEntry) -> Any:
    """The entry's body (or text) with the fixes applied in turn; the same object where none changed it."""
    if e.body is not None:
        body = e.body
        for f in fixes:
            body = f.body(body)
        return body
    text = e.text
    for f in fixes:
        if hasattr(f, "text"):
            text = f.text(text)
    return text

