"""Replay on the real cache equals a brute-force LRU written here from the cache's documented contract:
longest cached prefix (the last prompt token always computed), new blocks taken from never-cached free blocks
first and then from the least recently released cached block, blocks released tail first."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefix.cache import FreeBlockQueue, KVCacheBlock, KVCacheManager
from kvprefix.sim import replay as replay_module
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace, TraceRequest

BS = 4


def reference_lru(requests: list[TraceRequest], capacity: int) -> tuple[list[int | None], int]:
    """Per-request cached blocks (None: rejected) and evictions, with a plain list as the LRU order."""
    lru: list = []  # free cached hashes; front = evicted next
    cached: set = set()
    evictions = 0
    out: list[int | None] = []
    for r in requests:
        ids, n = r.block_hashes, r.input_length
        k = 0
        while k < min((n - 1) // BS, len(ids)) and ids[k] in cached:
            k += 1
        need = -(-n // BS) - k
        if need > capacity - k:
            out.append(None)
            continue
        for h in ids[:k]:
            lru.remove(h)
        evict = max(0, need - (capacity - len(cached)))  # never-cached free blocks go first
        for h in lru[:evict]:
            cached.remove(h)
        evictions += evict
        del lru[:evict]
        mine = list(ids[:k])
        for h in ids[k:]:
            if h not in cached:  # an already-cached hash stays with its first block
                cached.add(h)
                mine.append(h)
        lru.extend(reversed(mine))
        out.append(k)
    return out, evictions


@st.composite
def chained_traces(draw) -> list[TraceRequest]:
    """Requests over a tiny alphabet of block contents, with parent-chained ids like the real traces."""
    ids: dict[tuple, int] = {}
    requests = []
    for t in range(draw(st.integers(1, 30))):
        contents = draw(st.lists(st.integers(0, 2), min_size=0, max_size=6))
        n = len(contents) * BS + draw(st.integers(0 if contents else 1, BS - 1))
        chain = [ids.setdefault(tuple(contents[: i + 1]), len(ids)) for i in range(len(contents))]
        requests.append(TraceRequest(1000.0 * t, n, 0, chain, -(-n // BS)))
    return requests


@settings(max_examples=150, deadline=None)
@given(requests=chained_traces(), capacity=st.integers(1, 14))
def test_single_pool_matches_reference(requests, capacity):
    rec = replay(Trace("random", BS, requests), ReplayConfig(capacity, mode="order"))
    hits, evictions = reference_lru(requests, capacity)
    assert [None if rep < 0 else k for rep, k in zip(rec.replica, rec.cached_blocks, strict=True)] == hits
    assert sum(rec.evictions) == evictions


@settings(max_examples=80, deadline=None)
@given(requests=chained_traces(), capacity=st.integers(1, 14))
def test_timed_replay_without_overlap_matches_reference(requests, capacity):
    # Arrivals 1,000 s apart: every request finishes before the next arrives, so timing cannot matter.
    rec = replay(Trace("random", BS, requests), ReplayConfig(capacity, mode="timed"))
    hits, evictions = reference_lru(requests, capacity)
    assert [None if rep < 0 else k for rep, k in zip(rec.replica, rec.cached_blocks, strict=True)] == hits
    assert sum(rec.evictions) == evictions


@settings(max_examples=80, deadline=None)
@given(requests=chained_traces(), capacity=st.integers(1, 10), replicas=st.integers(2, 3))
def test_round_robin_matches_independent_references(requests, capacity, replicas):
    rec = replay(Trace("random", BS, requests), ReplayConfig(capacity, replicas=replicas, mode="order"))
    # Round robin skips nothing: request i goes to replica i mod N (a rejected one still takes its turn).
    for rep in range(replicas):
        mine = requests[rep::replicas]
        hits, evictions = reference_lru(mine, capacity)
        got = rec.cached_blocks[rep::replicas]
        assert [None if r < 0 else k for r, k in zip(rec.replica[rep::replicas], got, strict=True)] == hits
        assert rec.evictions[rep] == evictions


class MostRecentlyUsedFirst(FreeBlockQueue):
    """Evicts the most recently released cached block (never-cached blocks still go first)."""

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        block = first if first.block_hash is None else self._tail.prev_free
        if block is self._tail or block is self._head:
            raise IndexError("no free blocks")
        self.remove(block)
        return block


def test_eviction_policy_is_pluggable():
    # Three prompts of two blocks in a cycle, room for four blocks: LRU always evicts the prompt that comes next.
    prompts = [[10, 11], [20, 21], [30, 31]]
    requests = [TraceRequest(float(i), 2 * BS + 1, 0, prompts[i % 3], 3) for i in range(30)]
    trace = Trace("cycle", BS, requests)
    lru = replay(trace, ReplayConfig(5, mode="order"))
    mru = replay(trace, ReplayConfig(5, mode="order", free_queue_cls=MostRecentlyUsedFirst))
    assert sum(lru.cached_blocks) == 0
    assert sum(mru.cached_blocks) > 20


@settings(max_examples=80, deadline=None)
@given(
    requests=chained_traces(),
    gaps=st.lists(st.floats(0, 0.05), min_size=30, max_size=30),
    outputs=st.lists(st.integers(0, 12), min_size=30, max_size=30),
    capacity=st.integers(1, 14),
    replicas=st.integers(1, 3),
    routing=st.sampled_from(["round-robin", "kv-events", "shared"]),
)
def test_timed_replay_with_overlap_leaks_no_blocks(requests, gaps, outputs, capacity, replicas, routing):
    t = 0.0
    for r, gap, out in zip(requests, gaps, outputs, strict=False):
        t += gap
        r.timestamp, r.output_length = t, out
    managers = []

    class Recorded(KVCacheManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            managers.append(self)

    config = ReplayConfig(capacity, replicas=replicas, routing=routing, mode="timed", prefill_tps=100.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay_module, "KVCacheManager", Recorded)
        rec = replay(Trace("random", BS, requests), config)
    for m in managers:
        assert m.pool.num_free_blocks == m.pool.num_blocks and not m.req_to_blocks
    fits = [-(-(r.input_length + r.output_length) // BS) <= managers[0].pool.num_blocks for r in requests]
    assert [rep >= 0 for rep in rec.replica] == fits  # every request that fits is served, the others rejected
