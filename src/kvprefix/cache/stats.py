"""Prefix-cache counters. Counters only grow; rates are derived from them (hits / queries), never stored."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at a request's first admission
    hits: int = 0  # of those, tokens served from cached blocks
    requests: int = 0  # first admissions
    # Re-admissions after preemption, apart (as vLLM's): a request's own blocks would inflate the hit rate.
    preempted_queries: int = 0
    preempted_hits: int = 0
    preempted_requests: int = 0
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block
    resets: int = 0  # successful reset_prefix_cache calls

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def snapshot(self) -> PrefixCacheStats:
        return PrefixCacheStats(**{f.name: getattr(self, f.name) for f in fields(self)})
