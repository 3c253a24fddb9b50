"""What a replay found: hit rate three ways, prefill saved, evictions, per-replica balance, a TTFT estimate."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvprefix.sim.replay import ReplayConfig, ReplayRecords
from kvprefix.sim.trace import Trace

SINGLE = "single"  # the routing column of a one-replica run, where no routing happens

HIT_RATE_DEFINITIONS = {
    "token_hit_rate": "token-weighted: prompt tokens served from cache / all prompt tokens (= prefill tokens saved)",
    "block_hit_rate": "block-weighted: cached blocks / all prompt blocks (a partial last block counts as one)",
    "request_hit_rate": "per-request mean of each request's cached fraction of its prompt tokens",
}


@dataclass
class ReplicaSummary:
    replica: int
    requests: int
    prompt_tokens: int
    token_hit_rate: float
    load_share: float  # this replica's share of all admitted prompt tokens


@dataclass
class ReplaySummary:
    trace: str
    mode: str
    routing: str
    replicas: int
    block_size: int
    capacity_tokens: int | None  # per replica; None = unbounded
    requests: int
    admitted: int
    rejected: int  # could never fit in a replica's pool, even alone
    token_hit_rate: float
    block_hit_rate: float
    request_hit_rate: float
    prefill_tokens_without_cache: int
    prefill_tokens_with_cache: int
    prompt_blocks: int
    cached_blocks: int
    evictions: int
    load_imbalance: float  # busiest replica's load share x replicas (1.0 = even)
    per_replica: list[ReplicaSummary]
    prefill_tps: float
    mean_ttft_without_cache_s: float  # prefill time only, at prefill_tps; queueing not included
    mean_ttft_with_cache_s: float
    ttft_gain: float  # 1 - with / without
    waited: int  # timed mode: requests that queued, for blocks or behind another prefill on their replica
    mean_wait_s: float
    max_wait_s: float
    block_refs: int
    replay_s: float
    block_refs_per_s: float
    # With tiers below the pools (--disk-capacity, --shared-capacity): token_hit_rate is pool + disk + shared;
    # miss = 1 - token_hit_rate.
    disk_capacity_bytes: int | None = None  # per replica; None = no disk tier
    pool_token_hit_rate: float = 0.0  # prompt tokens served from the pool / all prompt tokens
    disk_token_hit_rate: float = 0.0  # prompt tokens loaded from the disk tier / all prompt tokens
    disk_evictions: int = 0
    shared_capacity_bytes: int | None = None  # the one shared tier below every pool; None = none
    shared_token_hit_rate: float = 0.0  # prompt tokens loaded from the shared tier / all prompt tokens
    shared_evictions: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(trace: Trace, config: ReplayConfig, rec: ReplayRecords) -> ReplaySummary:
    bs = trace.block_size
    n_rep = len(rec.pool_blocks)
    rep_tokens, rep_cached, rep_requests = [0] * n_rep, [0] * n_rep, [0] * n_rep
    prompt = cached = blocks = cached_blocks = disk_tokens = shared_tokens = 0
    fraction_sum = 0.0
    waits = []
    for r, rep, hit_blocks, disk_blocks, shared_blocks, wait in zip(
            trace.requests, rec.replica, rec.cached_blocks, rec.disk_blocks, rec.shared_blocks, rec.wait_s, strict=True):
        if rep < 0:
            continue
        hit_tokens = hit_blocks * bs
        disk_tokens += disk_blocks * bs
        shared_tokens += shared_blocks * bs
        prompt += r.input_length
        cached += hit_tokens
        blocks += r.num_blocks
        cached_blocks += hit_blocks
        fraction_sum += hit_tokens / r.input_length
        rep_tokens[rep] += r.input_length
        rep_cached[rep] += hit_tokens
        rep_requests[rep] += 1
        waits.append(wait)
    admitted = len(waits)
    per_replica = _per_replica(rep_requests, rep_tokens, rep_cached, prompt)
    ttft_without = _ratio(prompt, admitted) / config.prefill_tps
    ttft_with = _ratio(prompt - cached, admitted) / config.prefill_tps
    refs = trace.num_block_refs
    return ReplaySummary(
        trace=trace.name,
        mode=config.mode,
        routing=config.routing if config.replicas > 1 else SINGLE,
        replicas=config.replicas,
        block_size=bs,
        capacity_tokens=None if config.capacity_blocks is None else config.capacity_blocks * bs,
        requests=len(trace.requests),
        admitted=admitted,
        rejected=len(trace.requests) - admitted,
        token_hit_rate=_ratio(cached, prompt),
        block_hit_rate=_ratio(cached_blocks, blocks),
        request_hit_rate=_ratio(fraction_sum, admitted),
        prefill_tokens_without_cache=prompt,
        prefill_tokens_with_cache=prompt - cached,
        prompt_blocks=blocks,
        cached_blocks=cached_blocks,
        evictions=sum(rec.evictions),
        load_imbalance=max(s.load_share for s in per_replica) * n_rep if prompt else 0.0,
        per_replica=per_replica,
        prefill_tps=config.prefill_tps,
        mean_ttft_without_cache_s=ttft_without,
        mean_ttft_with_cache_s=ttft_with,
        ttft_gain=1 - _ratio(ttft_with, ttft_without) if ttft_without else 0.0,
        waited=sum(1 for w in waits if w > 0),
        mean_wait_s=_ratio(sum(waits), admitted),
        max_wait_s=max(waits, default=0.0),
        block_refs=refs,
        replay_s=rec.elapsed_s,
        block_refs_per_s=_ratio(refs, rec.elapsed_s),
        disk_capacity_bytes=config.disk_capacity_bytes,
        pool_token_hit_rate=_ratio(cached - disk_tokens - shared_tokens, prompt),
        disk_token_hit_rate=_ratio(disk_tokens, prompt),
        disk_evictions=sum(rec.disk_evictions),
        shared_capacity_bytes=config.shared_capacity_bytes,
        shared_token_hit_rate=_ratio(shared_tokens, prompt),
        shared_evictions=rec.shared_evictions,
    )


def _per_replica(requests: list[int], tokens: list[int], cached: list[int], prompt: int) -> list[ReplicaSummary]:
    return [ReplicaSummary(i, requests[i], tokens[i], _ratio(cached[i], tokens[i]), _ratio(tokens[i], prompt))
            for i in range(len(requests))]


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
