"""The prefix policies credit a block below the pool at its load cost, on the router's real view and ledger: a block
on a replica's disk or in a shared tier it reads counts less than one in its pool and more than a miss; a shared
block any replica reading the store announced counts for every replica reading it, and for no other; a hot prefix
in the shared tier spreads by load, loaded where it goes; the loads queue as prefill. `prefix` (no events) does the
same from where it routed blocks, with the tiers the replicas' hellos announced."""

from __future__ import annotations

import pytest

from kvprefix.cache.event_index import BlockIndex, MediaIndex, StreamMirror
from kvprefix.cache.media import DISK, POOL, SHARED, Medium
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest
from kvprefix.router.ledger import Ledger
from kvprefix.router.policies import Held, RoutedIndex, make_policy

PREFIX = [f"h{i}" for i in range(10)]
REQUEST = RouteRequest((*PREFIX, "q"), None, num_blocks=12)  # 11 full blocks and a partial one
DISK_COST, SHARED_COST = 0.0625, 0.125  # binary fractions: the costs below add up exactly


def replica(name: str, pool=(), disk=(), shared=(), store: str | None = "redis-1", has_disk: bool = False) -> Replica:
    """A replica following its event stream (a synced mirror), with a shared tier (``store``) and a disk."""
    media = [Medium(POOL, 64)]
    if has_disk or disk:
        media.append(Medium(DISK, 1000, DISK_COST))
    if store is not None:
        media.append(Medium(SHARED, None, SHARED_COST, store))
    mirror = StreamMirror()
    mirror.blocks = MediaIndex({POOL: BlockIndex({h: (None, "") for h in pool}),
                                DISK: BlockIndex({h: (None, "") for h in disk}),
                                SHARED: BlockIndex({h: (None, "") for h in shared})})
    mirror.media, mirror.ready = {m.name: m for m in media}, True
    return Replica(name, healthy=True, mirror=mirror)


def test_a_shared_tier_reader_scores_between_the_pool_holder_and_a_cold_replica():
    """A computed the prefix (its pool holds it, and it announced it written to the shared tier); B reads the same
    store and never computed it; C reads another store; D has no shared tier."""
    view = FleetView([replica("A", pool=PREFIX, shared=PREFIX), replica("B"), replica("C", store="redis-2"),
                      replica("D", store=None)])
    held = [view.held_prefix(r, REQUEST.block_hashes) for r in range(4)]
    assert held == [Held(pool=10), Held(shared=10, shared_cost=SHARED_COST), Held(), Held()]
    assert [h.credit for h in held] == [10, 10 - 10 * SHARED_COST, 0, 0]
    policy = make_policy("kv-events")
    assert policy.choose(REQUEST, view).replica == 0  # an idle fleet: the pool holder


def test_a_hot_prefix_in_the_shared_tier_spreads_by_load_and_is_loaded_not_computed():
    """The pool holder busy (a request prefilling there, within the load cap): the next request goes to a replica
    that loads the prefix from the shared tier, never to one that would compute it; credited with every prefix
    block, its loads queued as prefill there."""
    view = FleetView([replica("A", pool=PREFIX, shared=PREFIX), replica("B"), replica("D", store=None)])
    ledger = Ledger(make_policy("kv-events"))
    view.replicas[0].outstanding.add([], 4)  # 4 blocks of prefill queued on A: more than B's loads cost
    decision, routed = ledger.route(REQUEST, view)
    assert (decision.replica, decision.credited, decision.reason) == (1, 10, "cached_prefix")
    assert decision.load_cost == 10 * SHARED_COST
    assert view.queued_prefill_blocks(1) == 12 - 10 + 10 * SHARED_COST  # the partial tail and q, plus the loads
    routed.finish()
    assert view.queued_prefill_blocks(1) == 0  # settled exactly
    # Without the shared tier the same fleet keeps the prefix on A (computing it elsewhere costs more).
    bare = FleetView([replica("A", pool=PREFIX, store=None), replica("B", store=None), replica("D", store=None)])
    bare.replicas[0].outstanding.add([], 4)
    assert Ledger(make_policy("kv-events")).choose(REQUEST, bare).replica == 0


def test_the_engines_order_pool_then_disk_then_shared():
    """The pool's leading blocks, then the disk's from there, then the shared tier's from where the disk stops:
    a block on the disk after a gap counts for nothing."""
    a = replica("A", pool=PREFIX[:3], disk=PREFIX[:6] + PREFIX[7:], shared=PREFIX)
    view = FleetView([a])
    assert view.held_prefix(0, REQUEST.block_hashes) == Held(3, 3, 4, DISK_COST, SHARED_COST)
    lone = FleetView([replica("A", disk=PREFIX, store=None)])
    held = lone.held_prefix(0, REQUEST.block_hashes)
    assert held == Held(disk=10, disk_cost=DISK_COST) and Held(pool=10).credit > held.credit > 0
    unsynced = replica("A", disk=PREFIX)
    unsynced.mirror.ready = False  # a mirror that lost its stream knows nothing
    assert FleetView([unsynced]).held_prefix(0, REQUEST.block_hashes) == Held()


@pytest.mark.parametrize("media", [{}, {POOL: Medium(POOL, 4)}])
def test_prefix_without_tiers_routes_as_before(media):
    routed = RoutedIndex(8)
    routed.record(0, PREFIX[:6], media)
    assert routed.held(0, PREFIX, media) == Held(pool=6)


def test_prefix_spills_a_pools_worth_to_the_disk_and_shares_the_shared_tier():
    """`prefix` with the replicas' tiers: a replica's pool part holds its pool's capacity, what falls out goes to
    its disk part; every block routed to a replica reading a shared store counts for each replica reading it; a
    reset replica keeps its disk."""
    disk_and_shared = {POOL: Medium(POOL, 4), DISK: Medium(DISK, 100, DISK_COST),
                       SHARED: Medium(SHARED, None, SHARED_COST, "redis-1")}
    shared_only = {POOL: Medium(POOL, 4), SHARED: Medium(SHARED, None, SHARED_COST, "redis-1")}
    other_store = {POOL: Medium(POOL, 4), SHARED: Medium(SHARED, None, SHARED_COST, "redis-2")}
    routed = RoutedIndex(1 << 10)
    routed.record(0, PREFIX[:6], disk_and_shared)  # four blocks fit the pool: the two deepest go to the disk
    assert routed.held(0, PREFIX, disk_and_shared) == Held(4, 2, 0, DISK_COST)
    assert routed.held(1, PREFIX, shared_only) == Held(shared=6, shared_cost=SHARED_COST)
    assert routed.held(2, PREFIX, other_store) == Held()
    routed.forget(0)  # restarted: its pool is empty, its disk holds all six
    assert routed.held(0, PREFIX, disk_and_shared) == Held(disk=6, disk_cost=DISK_COST)
    policy, view = make_policy("prefix"), FleetView([Replica(n, True, media_info=m) for n, m in
                                                     (("A", disk_and_shared), ("B", shared_only))])
    first = policy.choose(REQUEST, view)
    assert first.credited == 0
    # the replica that computed it busy: the other loads it from the shared tier
    view.replicas[first.replica].outstanding.add([], 4)
    second = policy.choose(REQUEST, view)
    assert second.replica != first.replica and second.credited == 11 and second.load_cost == 11 * SHARED_COST
