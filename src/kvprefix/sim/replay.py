"""Replays a trace on real ``KVCacheManager``s, one per replica, routed by a ``kvprefix.router`` policy.

Two modes:
- ``order``: only the order of requests matters; each request is admitted, its prompt blocks registered and
  released at once (what published simulations such as Mooncake's Figure 9 do): the fleet is idle at every
  decision, so load-aware policies see no load.
- ``timed``: requests arrive at their timestamps and hold their blocks (prompt + output) while they run. Each
  replica prefills one request at a time (FIFO), taking uncached tokens / ``prefill_tps``; then the request
  decodes alongside the others for ``output_length / decode_tps``. The cache lookup happens when prefill starts
  and blocks are registered when it ends. A request waits while its blocks do not fit; one that could never
  fit, even alone, is rejected.

With ``disk_capacity_bytes`` each replica's pool has a disk tier below it, with ``shared_capacity_bytes`` one shared
tier is below every pool (``sim.tiers``): after the pool's hits, the blocks the disk holds, then those the shared
tier holds, are loaded and count as disk and shared hits. In timed mode a loaded block costs ``*_load_cost`` blocks
of prefill time; the routing policies see the tiers and weigh them at those costs, as the router sees a replica's.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

from kvprefix.cache import CacheRequest, FreeBlockQueue, KVCacheManager, cdiv
from kvprefix.cache.media import DEFAULT_LOAD_COST, DISK, MAX_LOAD_COST, MIN_LOAD_COST, POOL, Medium
from kvprefix.cache.media import SHARED as SHARED_TIER
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.ledger import Ledger
from kvprefix.router.pending import Routed
from kvprefix.router.policies import POLICIES, make_policy
from kvprefix.sim.tiers import SimTier
from kvprefix.sim.trace import Trace, TraceRequest

MODES = ("order", "timed")
# SmolLM2-135M's (the default model's) KV per token in bfloat16: 30 layers x (K, V) x 3 KV heads x 64 x 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
SHARED = "shared"  # not a routing policy: one pool of replicas x capacity, the upper bound for any router
ROUTINGS = (*POLICIES, SHARED)


@dataclass(frozen=True)
class ReplayConfig:
    capacity_blocks: int | None  # per replica; None = unbounded (nothing is ever evicted)
    replicas: int = 1
    routing: str = "round-robin"
    mode: str = "order"
    prefill_tps: float = 10_000.0  # prompt tokens per second per replica (durations and the TTFT estimate)
    decode_tps: float = 50.0  # output tokens per second per request
    load_cap: float = 1.25
    seed: int = 0
    free_queue_cls: type[FreeBlockQueue] = FreeBlockQueue  # the pools' eviction: its popleft picks the victim
    disk_capacity_bytes: int | None = None  # a disk tier below each replica's pool; None = none
    shared_capacity_bytes: int | None = None  # one shared tier below every replica's pool; None = none
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN  # a tier object's size per token of its block
    disk_load_cost: float = DEFAULT_LOAD_COST  # blocks of prefill one block loaded from the disk costs
    shared_load_cost: float = DEFAULT_LOAD_COST  # ... from the shared tier

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity must be at least one block, got {self.capacity_blocks} blocks")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.load_cap < 1.0:
            raise ValueError(f"load_cap must be >= 1.0, got {self.load_cap}")
        if self.prefill_tps <= 0 or self.decode_tps <= 0:
            raise ValueError("prefill and decode throughput must be > 0 tokens/s")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        for name, cost in (("disk", self.disk_load_cost), ("shared", self.shared_load_cost)):
            if not MIN_LOAD_COST <= cost <= MAX_LOAD_COST:
                raise ValueError(f"the {name} load cost must be between {MIN_LOAD_COST} and {MAX_LOAD_COST} blocks "
                                 f"of prefill, got {cost}")


@dataclass
class ReplayRecords:
    """Per-request outcome, indexed like the trace; replica -1 means rejected (could never fit)."""

    replica: list[int]
    cached_blocks: list[int]  # from the pool and the tiers together
    disk_blocks: list[int]  # of cached_blocks, those loaded from the disk tier
    shared_blocks: list[int]  # of cached_blocks, those loaded from the shared tier
    wait_s: list[float]
    evictions: list[int]  # per replica
    pool_blocks: list[int]  # per replica
    disk_evictions: list[int]  # per replica (empty without a disk tier)
    shared_evictions: int  # of the shared tier
    elapsed_s: float


class Tiers:
    """The tiers below the replay's pools: a disk per pool (or none), one shared tier (or none), and what loading
    from each costs."""

    def __init__(self, config: ReplayConfig, managers: list[KVCacheManager], bs: int):
        block_bytes = bs * config.kv_bytes_per_token
        scale = config.replicas if config.routing == SHARED else 1  # the shared pool's disk: replicas x as large
        self.disks = ([] if config.disk_capacity_bytes is None else
                      [SimTier(config.disk_capacity_bytes * scale, block_bytes) for _ in managers])
        self.shared = (None if config.shared_capacity_bytes is None else
                       SimTier(config.shared_capacity_bytes, block_bytes, "shared"))
        self.costs = {DISK: config.disk_load_cost, SHARED_TIER: config.shared_load_cost}
        for i, m in enumerate(managers):  # written by their pools' events, as the engine writes behind
            if self.disks:
                m.events.subscribe(self.disks[i].on_event)
            if self.shared is not None:
                m.events.subscribe(self.shared.on_event)

    def hits(self, rep: int, req: CacheRequest, num_pool_hits: int, bs: int) -> tuple[int, int]:
        """Blocks after the pool's hits loaded from the replica's disk, then from the shared tier (the last prompt
        token is always computed, as in the pool's lookup)."""
        following = req.block_hashes[num_pool_hits : (req.num_tokens - 1) // bs]
        disk = self.disks[rep].load_following(following) if self.disks else 0
        shared = self.shared.load_following(following[disk:]) if self.shared is not None else 0
        return disk, shared

    def load_cost(self, disk: int, shared: int) -> float:
        """Blocks of prefill the loads of ``disk`` and ``shared`` blocks cost."""
        return disk * self.costs[DISK] + shared * self.costs[SHARED_TIER]

    def replica(self, i: int, manager: KVCacheManager) -> Replica:
        """Replica ``i`` as the router would see it: its pool, its disk, the shared tier, with their sizes and costs."""
        media = {POOL: Medium(POOL, manager.pool.num_blocks)}
        held: dict = {}
        for medium, tier in ((DISK, self.disks[i] if self.disks else None), (SHARED_TIER, self.shared)):
            if tier is not None:
                media[medium] = Medium(medium, tier.capacity_bytes // tier.block_bytes, self.costs[medium], "sim")
                held[medium] = tier.index
        return Replica(f"replica-{i}", healthy=True, cached=manager.pool.cached_blocks, tier_cached=held,
                       media_info=media)


def pools_view(managers: list[KVCacheManager], tiers: Tiers) -> FleetView:
    """The router's view of the replay's replicas: always healthy, holding what their pools and tiers hold; load is
    what was routed there and has not finished, as `kvprefix route` counts it."""
    return FleetView([tiers.replica(i, m) for i, m in enumerate(managers)])


def unbounded_capacity_blocks(trace: Trace) -> int:
    """Enough blocks that nothing is evicted even if every request ran at once."""
    bs = trace.block_size
    return sum(cdiv(r.input_length + r.output_length, bs) for r in trace.requests)


def replay(trace: Trace, config: ReplayConfig, progress: bool = False) -> ReplayRecords:
    bs = trace.block_size
    per_replica = config.capacity_blocks or unbounded_capacity_blocks(trace)
    queue_cls = config.free_queue_cls
    if config.routing == SHARED:
        managers = [KVCacheManager(per_replica * config.replicas, bs, free_queue_cls=queue_cls)]
    else:
        managers = [KVCacheManager(per_replica, bs, free_queue_cls=queue_cls) for _ in range(config.replicas)]
    ledger = None if len(managers) == 1 else Ledger(make_policy(config.routing, config.seed, config.load_cap))
    tiers = Tiers(config, managers, bs)
    n = len(trace.requests)
    rec = ReplayRecords([-1] * n, [0] * n, [0] * n, [0] * n, [0.0] * n, [], [m.pool.num_blocks for m in managers],
                        [], 0, 0.0)
    bar = _progress_bar(n, trace.name, progress)
    start = time.perf_counter()
    if config.mode == "order":
        _replay_order(trace.requests, bs, managers, tiers, ledger, rec, bar)
    else:
        # The shared pool stands for all replicas' memory *and* compute: it prefills replicas x as fast.
        prefill_tps = config.prefill_tps * (config.replicas if config.routing == SHARED else 1)
        _replay_timed(trace.requests, bs, managers, tiers, ledger, prefill_tps, config.decode_tps, rec, bar)
    rec.elapsed_s = time.perf_counter() - start
    rec.evictions = [m.stats.evictions for m in managers]
    rec.disk_evictions = [d.evictions for d in tiers.disks]
    rec.shared_evictions = tiers.shared.evictions if tiers.shared is not None else 0
    if bar is not None:
        bar.update(n - bar.n)
        bar.close()
    return rec


def _progress_bar(total: int, name: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="req", file=sys.stderr, mininterval=0.5, leave=False)


_BAR_STEP = 1024  # update the bar every so many requests: tqdm per request would cost more than the replay


def _replay_order(reqs: list[TraceRequest], bs: int, managers: list[KVCacheManager], tiers: Tiers,
                  ledger: Ledger | None, rec, bar) -> None:
    view = pools_view(managers, tiers)
    rec_replica, rec_blocks = rec.replica, rec.cached_blocks
    for i, r in enumerate(reqs):
        decision = None if ledger is None else ledger.choose(r, view)
        rep = 0 if decision is None else decision.replica
        mgr = managers[rep]
        req = CacheRequest.from_block_hashes(str(i), r.block_hashes, r.input_length, bs)
        hits, num_hit_tokens = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, r.input_length - num_hit_tokens, hits) is None:
            continue  # larger than the whole pool: rejected
        disk, shared = tiers.hits(rep, req, len(hits), bs)
        mgr.cache_blocks(req, r.input_length)
        mgr.free(req)
        if decision is not None:  # in order mode nothing stays in flight: each request ends before the next
            ledger.record(r, decision, view.replicas[rep].outstanding).finish()
        rec_replica[i] = rep
        rec_blocks[i] = len(hits) + disk + shared
        rec.disk_blocks[i], rec.shared_blocks[i] = disk, shared
        if bar is not None and (i + 1) % _BAR_STEP == 0:
            bar.update(_BAR_STEP)


_PREFILL_DONE, _FINISH = 0, 1


def _replay_timed(reqs: list[TraceRequest], bs: int, managers: list[KVCacheManager], tiers: Tiers,
                  ledger: Ledger | None, prefill_tps: float, decode_tps: float, rec: ReplayRecords, bar) -> None:
    timed = _Timed(reqs, bs, managers, tiers, ledger, prefill_tps, decode_tps, rec)
    view = timed.view
    for i, r in enumerate(reqs):
        timed.run_events(r.timestamp)
        decision = None if ledger is None else ledger.choose(r, view)
        rep = 0 if decision is None else decision.replica
        if cdiv(r.input_length + r.output_length, bs) > managers[rep].pool.num_blocks:
            continue  # could never fit, even alone: rejected
        if decision is not None:
            timed.routed[i] = ledger.record(r, decision, view.replicas[rep].outstanding)
        timed.queues[rep].append(i)
        timed.start_next(rep, r.timestamp)
        if bar is not None and (i + 1) % _BAR_STEP == 0:
            bar.update(_BAR_STEP)
    timed.run_events(math.inf)


class _Timed:
    """The timed replay's state: per replica a FIFO of requests waiting for the prefill unit, and one heap of
    events (prefill done, request finished) in time order."""

    def __init__(self, reqs: list[TraceRequest], bs: int, managers: list[KVCacheManager], tiers: Tiers,
                 ledger: Ledger | None, prefill_tps: float, decode_tps: float, rec: ReplayRecords):
        self.reqs, self.bs, self.managers, self.ledger, self.rec = reqs, bs, managers, ledger, rec
        self.tiers = tiers
        self.prefill_tps, self.decode_tps = prefill_tps, decode_tps
        self.view = pools_view(managers, tiers)
        self.routed: dict[int, Routed] = {}  # trace index -> its share of the replica's load, until it finishes
        self.queues: list[deque[int]] = [deque() for _ in managers]
        self.prefilling = [False] * len(managers)
        # (time, seq, kind, replica, trace index, request); seq keeps simultaneous events in push order
        self.events: list[tuple[float, int, int, int, int, CacheRequest]] = []
        self.seq = 0

    def push(self, when: float, kind: int, rep: int, i: int, req: CacheRequest) -> None:
        heapq.heappush(self.events, (when, self.seq, kind, rep, i, req))
        self.seq += 1

    def start_next(self, rep: int, now: float) -> None:
        """Admits the replica's first waiting request into prefill if the prefill unit is idle and blocks fit.
        The lookup happens here, so a request queued behind one with the same prefix hits it."""
        queue = self.queues[rep]
        if self.prefilling[rep] or not queue:
            return
        i = queue[0]
        r = self.reqs[i]
        mgr = self.managers[rep]
        req = CacheRequest.from_block_hashes(str(i), r.block_hashes, r.input_length, self.bs)
        hits, num_hit_tokens = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, r.input_length - num_hit_tokens + r.output_length, hits) is None:
            return  # waits for a running request to finish and release blocks
        queue.popleft()
        disk, shared = self.tiers.hits(rep, req, len(hits), self.bs)
        self.prefilling[rep] = True
        rec = self.rec
        rec.replica[i] = rep
        rec.cached_blocks[i] = len(hits) + disk + shared
        rec.disk_blocks[i], rec.shared_blocks[i] = disk, shared
        rec.wait_s[i] = now - r.timestamp
        # The blocks found nowhere are computed; those loaded from a tier cost their load cost in prefill time.
        computed = r.input_length - num_hit_tokens - (disk + shared - self.tiers.load_cost(disk, shared)) * self.bs
        self.push(now + computed / self.prefill_tps, _PREFILL_DONE, rep, i, req)

    def run_events(self, until: float) -> None:
        events = self.events
        while events and events[0][0] <= until:
            now, _, kind, rep, i, req = heapq.heappop(events)
            mgr = self.managers[rep]
            if kind == _PREFILL_DONE:
                mgr.cache_blocks(req, req.num_tokens)
                if self.ledger is not None:
                    self.routed[i].prefilled()
                self.prefilling[rep] = False
                self.push(now + self.reqs[i].output_length / self.decode_tps, _FINISH, rep, i, req)
            else:
                mgr.free(req)
                if self.ledger is not None:
                    self.routed.pop(i).finish()
            self.start_next(rep, now)
