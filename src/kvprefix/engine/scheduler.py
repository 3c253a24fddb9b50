"""Continuous batching with chunked prefill and preemption by recompute, over the prefix-caching KV cache manager."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvprefix.cache import KVCacheManager
from kvprefix.engine.request import Request, RequestStatus


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


class Scheduler:
    """Each step: running requests first (decodes and unfinished prefill chunks), then admissions from the waiting
    queue, all under ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences.

    Prefill and decode are one mechanism: a request is scheduled for the tokens it has not computed yet; when a
    step computes its last token, a new token is sampled. Admission asks the cache manager for cached blocks
    first, so cached tokens cost no budget. When the pool is full, the latest-admitted running request is
    preempted: its blocks are freed (they stay cached) and it goes back to the front of the queue.
    """

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
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

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
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
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.needs_prompt_from_leader():
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = ([], 0) if req.skips_cache_reads else self.manager.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.manager.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _preempt(self, req: Request) -> None:
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances progress and registers blocks that became full (their KV is now written)."""
        manager = self.manager
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            req.num_computed_tokens += s.num_new_tokens
            self.num_prompt_tokens_computed += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - start)
            manager.cache_blocks(req, req.num_computed_tokens)

    def finish(self, req: Request) -> None:
        """Removes a finished or aborted request from the queues and releases its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.manager.free(req)
