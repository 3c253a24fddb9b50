"""Continuous batching with chunked prefill and preemption by recompute, over the prefix-caching KV cache manager."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvprefix.cache import KVCacheManager
from kvprefix.engine.inflight import InflightPrefixes
from kvprefix.engine.request import Request, RequestStatus
from kvprefix.engine.tier_loads import LoadState


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


SCHEDULING_POLICIES = ("fcfs", "cache_aware")


class Scheduler:
    """Each step: running requests first (decodes and unfinished prefill chunks), then admissions from the waiting
    queue, all under ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences.

    Prefill and decode are one mechanism: a request is scheduled for the tokens it has not computed; a step that
    computes its last token samples a new one. Cached tokens cost no budget. When the pool is full, the
    latest-admitted running request is preempted (blocks freed but still cached, back to the queue's front).
    With ``share_inflight_prefixes``, a request waiting on blocks a running one is computing keeps its place while
    later ones pass (``InflightPrefixes``). ``scheduling_policy``: see ``_admission_order``. ``lower_tier``: blocks
    past the pool's hits are loaded from it before admission, while other requests step (``engine.tier_loads``).
    ``max_loras``: at most that many LoRA adapters among the running requests (a request of another adapter waits,
    keeping its place).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        share_inflight_prefixes: bool = True,
        scheduling_policy: str = "fcfs",
        max_wait_steps: int = 100,
        lower_tier=None,
        max_loras: int | None = None,
    ):
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {scheduling_policy!r}"
            )
        if max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {max_wait_steps}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (not served from the cache)
        self.num_steps = 0
        self.scheduling_policy = scheduling_policy
        self.max_wait_steps = max_wait_steps
        self.max_loras = max_loras
        self.lower_tier = lower_tier  # a KVTier (engine.kv_tier): asked for the blocks after the pool's hits
        self.inflight = (
            InflightPrefixes(manager.block_size, max_num_batched_tokens)
            if share_inflight_prefixes and manager.enable_prefix_caching
            else None
        )

    def add(self, request: Request) -> None:
        request.queued_step = self.num_steps
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.manager.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # the latest admitted; never one already scheduled (those are < i)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
        # Admit only when nothing was preempted: a preempted request would otherwise be re-admitted at once.
        if not preempted:
            budget = self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting:
            return budget
        inflight = self.inflight
        if self.lower_tier is not None:
            self.lower_tier.loads.reap()
        admitted: set[int] = set()
        adapters = {id(r.lora) for r in self.running if r.lora is not None}
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.lora is not None and id(req.lora) not in adapters and len(adapters) >= (self.max_loras or 0):
                continue  # its adapter would be one too many in the batch
            if req.skips_cache_reads:  # computes its whole prompt anyway: nothing to wait for
                hits, num_hit_tokens = [], 0
            else:
                # Looked up now, not when ranking: an admission before this one may have evicted free cached blocks.
                hits, num_hit_tokens = self.manager.get_computed_blocks(req)
                if self.lower_tier is not None:
                    state = self.lower_tier.loads.poll(req, hits)
                    if state is LoadState.WAIT:
                        continue  # its blocks are being loaded: keeps its place in the queue
                    if state is LoadState.LOADED:
                        hits, num_hit_tokens = self.manager.get_computed_blocks(req)  # now with the loaded blocks
                if inflight is not None and inflight.should_wait(req, len(hits), self.num_steps):
                    continue  # keeps its place in the queue
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.manager.allocate_slots(req, num_new, hits) is None:
                break
            admitted.add(id(req))
            if req.lora is not None:
                adapters.add(id(req.lora))
            req.status = RequestStatus.RUNNING
            req.inflight_wait = None
            self.running.append(req)
            if inflight is not None:
                inflight.add(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return budget

    def _admission_order(self) -> list[Request]:
        """FCFS: the queue as it is. Cache-aware: preempted requests and those waiting ``max_wait_steps`` first (so
        nobody starves), then by cached prompt tokens, most first (SGLang's longest-prefix-match); ties in order."""
        if self.scheduling_policy == "fcfs" or len(self.waiting) < 2:
            return list(self.waiting)
        step, max_wait = self.num_steps, self.max_wait_steps
        lookup = self.manager.get_computed_blocks

        def rank(item: tuple[int, Request]) -> tuple[int, int, int]:
            pos, req = item
            if req.num_cached_tokens >= 0 or step - req.queued_step >= max_wait:
                return (0, 0, pos)
            return (1, 0 if req.skips_cache_reads else -lookup(req)[1], pos)

        return [req for _, req in sorted(enumerate(self.waiting), key=rank)]

    def _preempt(self, req: Request) -> None:
        self._leave_running(req)
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        req.num_preemptions += 1

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances progress and registers blocks that became full (their KV is now written)."""
        manager = self.manager
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            req.num_computed_tokens += s.num_new_tokens
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - start)
            manager.cache_blocks(req, req.num_computed_tokens)

    # ---- beams (engine beam search: LLMEngine forks and parks the beams of a search between its steps)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Starts ``child``, a new beam of the running ``parent``, in the running set on the parent's blocks
        (``KVCacheManager.fork``); returns the block copies the runner must make first. None when there is no seat
        or no block for it: the caller queues it (``resume``) to recompute from the parent's cached blocks."""
        if parent.status is not RequestStatus.RUNNING or len(self.running) >= self.max_num_seqs:
            return None
        copies = self.manager.fork(parent, child)
        if copies is not None:
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        return copies

    def park(self, req: Request) -> None:
        """A beam whose next token waits for its siblings' (they were not all computed in one step) leaves with its
        seat and blocks (its full blocks stay cached): a waiting beam never holds what another request needs."""
        self.finish(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING

    def resume(self, req: Request) -> None:
        """A beam that holds no blocks goes to the front of the queue; its admission hits its cached blocks."""
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.queued_step = self.num_steps
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Removes a finished or aborted request from the queues and releases its blocks."""
        if req in self.running:
            self.running.remove(req)
            self._leave_running(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.manager.free(req)
        if self.lower_tier is not None:
            self.lower_tier.loads.forget(req)

    def _leave_running(self, req: Request) -> None:
        """Whoever waits behind ``req``'s in-flight blocks is free to go (hitting whatever it registered)."""
        if self.inflight is not None:
            self.inflight.remove(req)
