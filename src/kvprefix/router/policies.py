"""Routing policies: which replica serves a request.

A policy sees a request (its block hashes and session key) and a ``ReplicaView`` of the replicas (which are
healthy, their load, and where each holds the request's leading blocks: its pool, its disk, a shared tier it
reads). The planner implements the view with real ``KVCacheManager``s; the HTTP router implements it with replica
health, in-flight counts and indexes fed by KV cache events. The same policy objects serve both, and none of them
knows about HTTP, so any request router (a Ray Serve one, say) can call them.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import xxhash

from kvprefix.cache import leading_blocks_in
from kvprefix.cache.media import DISK, POOL, SHARED, Medium


class Routable(Protocol):
    """What a policy reads from a request: full-block hashes (chained), an optional session key, and how many
    blocks its prompt spans (the partial tail included; 0 when unknown)."""

    block_hashes: Sequence[Hashable]
    session: Hashable | None
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Held:
    """Where a replica holds a request's leading blocks: ``pool`` in its pool (or being computed there for a request
    routed before), then ``disk`` more on its disk, then ``shared`` more in a shared tier it reads (the order the
    engine asks them in); loading one costs ``disk_cost`` / ``shared_cost`` blocks of prefill (``cache.media``)."""

    pool: int = 0
    disk: int = 0
    shared: int = 0
    disk_cost: float = 0.0
    shared_cost: float = 0.0

    @property
    def blocks(self) -> int:
        """Blocks the replica will not compute: its cached tokens, in blocks."""
        return self.pool + self.disk + self.shared

    @property
    def load_cost(self) -> float:
        """Blocks of prefill the loads from its tiers cost, in 1/1024 blocks (binary fractions: a replica's queued
        prefill adds and later subtracts them exactly)."""
        return round((self.disk * self.disk_cost + self.shared * self.shared_cost) * 1024) / 1024

    @property
    def credit(self) -> float:
        """Blocks of prefill saved: a pool block is worth one, a tier block one less its load cost, a miss none."""
        return self.blocks - self.load_cost


NOT_HELD = Held()
NO_TIERS: Mapping[str, Medium] = MappingProxyType({})  # a replica whose media nobody announced: its pool only


def held_below(pool: int, block_hashes: Sequence[Hashable], media: Mapping[str, Medium],
               disk: Container[Hashable] | None, shared: Container[Hashable] | None) -> Held:
    """``Held`` of a chain whose first ``pool`` blocks are in the pool: the blocks after them on the disk
    (``disk``: its blocks, where ``media`` has one), then in the shared tier (``shared``), as the engine looks."""
    n, on_disk, in_shared = len(block_hashes), 0, 0
    if pool < n and disk is not None and DISK in media:
        on_disk = leading_blocks_in(disk, block_hashes[pool:])
    if pool + on_disk < n and shared is not None and SHARED in media:
        in_shared = leading_blocks_in(shared, block_hashes[pool + on_disk:])
    return Held(pool, on_disk, in_shared, media[DISK].load_cost if on_disk else 0.0,
                media[SHARED].load_cost if in_shared else 0.0)


class ReplicaView(Protocol):
    num_replicas: int

    def healthy(self, replica: int) -> bool:
        """Whether the replica may be chosen now (the planner's replicas always are)."""
        ...

    def held_prefix(self, replica: int, block_hashes: Sequence[Hashable]) -> Held:
        """Where the replica holds the leading blocks of ``block_hashes`` (in its pool: cached, or being computed for
        a routed request; then on its disk; then in a shared tier it reads)."""
        ...

    def media(self, replica: int) -> Mapping[str, Medium]:
        """Where the replica holds blocks (``cache.media``), with their capacities and load costs."""
        ...

    def load(self, replica: int) -> float:
        """Requests routed to the replica and not finished (queued or running)."""
        ...

    def queued_prefill_blocks(self, replica: int) -> float:
        """Prompt blocks of those requests still to prefill: what the policy did not credit them as cached, until
        their first token is out (``pending.Outstanding``)."""
        ...


# Why a replica was chosen: a retry after another failed or refused, a cached prefix there, a session key, or none.
REASONS = ("retry", "cached_prefix", "session", "no_prefix")


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing decision: the replica (a view position), the leading blocks of the request credited as cached
    there (in its pool or loaded from its tiers), the blocks of prefill loading those from tiers costs
    (``load_cost``), why (``REASONS``), and the replicas (by name) that were chosen for it before and refused it."""

    replica: int
    credited: int = 0
    reason: str = "no_prefix"
    refused: tuple[str, ...] = ()
    load_cost: float = 0.0


class RoutingPolicy(Protocol):
    name: str
    reads_cache: bool  # whether ``choose`` asks the view what replicas cache (then requests in flight count)

    def choose(self, request: Routable, view: ReplicaView) -> Decision: ...

    def forget(self, replica: int) -> None:
        """The replica restarted or was reset: it holds nothing this policy remembers sending it."""
        ...


def candidates(view: ReplicaView) -> list[int]:
    """The healthy replicas; all of them when none is (a request must go somewhere, and fail visibly)."""
    up = [r for r in range(view.num_replicas) if view.healthy(r)]
    return up or list(range(view.num_replicas))


def least_loaded(replicas: Sequence[int], view: ReplicaView, rng: random.Random) -> int:
    """The least loaded of ``replicas``, ties broken at random (so equal replicas share the work)."""
    low = min(view.load(r) for r in replicas)
    return rng.choice([r for r in replicas if view.load(r) == low])


def load_bound(view: ReplicaView, replicas: Sequence[int], load_cap: float) -> int:
    """The load a replica may reach by taking the request: ``load_cap`` x the mean after adding it, rounded up.
    Bounded-load consistent hashing (Mirrokni et al.); with load_cap >= 1 some replica is always under it."""
    total = sum(view.load(r) for r in replicas) + 1
    return math.ceil(load_cap * total / len(replicas))


class _Stateless:
    """What a policy that remembers nothing about replicas' caches shares: nothing to read, nothing to forget."""

    reads_cache = False

    def forget(self, replica: int) -> None:
        pass


class RoundRobin(_Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Routable, view: ReplicaView) -> Decision:
        n = view.num_replicas
        for step in range(n):
            replica = (self._next + step) % n
            if view.healthy(replica):
                break
        else:
            replica = self._next % n
        self._next = replica + 1
        return Decision(replica)


class RandomChoice(_Stateless):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: Routable, view: ReplicaView) -> Decision:
        return Decision(self._rng.choice(candidates(view)))


class LeastLoad(_Stateless):
    """Power of two choices: the less loaded of two replicas drawn at random. Nearly as even as asking every
    replica, without every router sending to the one that looked idlest a moment ago."""

    name = "least-load"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: Routable, view: ReplicaView) -> Decision:
        up = candidates(view)
        pair = self._rng.sample(up, min(2, len(up)))
        return Decision(least_loaded(pair, view, self._rng))


def _stable_hash(key: Hashable) -> int:
    # Python's hash() is salted per process; a router fleet must agree on placement.
    return xxhash.xxh64_intdigest(repr(key).encode())


class SessionAffinity(_Stateless):
    """A session (``prompt_cache_key``, ``user``, an ``x-session-id`` header, a trace's session id) lands on its
    replica of a hash ring, so a conversation keeps hitting its own history; adding a replica moves about 1/N of
    the sessions. The load is bounded: a replica over ``load_cap`` x the mean is passed over for the next one on
    the ring, so a few heavy sessions cannot herd onto one replica. A request without a session has no affinity
    to keep and goes by load (power of two choices)."""

    name = "session"

    def __init__(self, load_cap: float = 1.25, seed: int = 0, virtual_nodes: int = 64) -> None:
        if load_cap < 1.0:
            raise ValueError(f"load_cap must be >= 1.0, got {load_cap}")
        self.load_cap = load_cap
        self.virtual_nodes = virtual_nodes
        self._fallback = LeastLoad(seed)
        self._ring_size = 0
        self._points: list[int] = []
        self._owners: list[int] = []

    def _build(self, num_replicas: int) -> None:
        ring = sorted(
            (_stable_hash(f"replica-{r}/vnode-{v}"), r) for r in range(num_replicas) for v in range(self.virtual_nodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]
        self._ring_size = num_replicas

    def choose(self, request: Routable, view: ReplicaView) -> Decision:
        if request.session is None:
            return self._fallback.choose(request, view)
        if view.num_replicas != self._ring_size:
            self._build(view.num_replicas)
        up = candidates(view)
        bound = load_bound(view, up, self.load_cap)
        allowed = set(up)
        start = bisect.bisect(self._points, _stable_hash(request.session))
        first = None
        for step in range(len(self._points)):
            replica = self._owners[(start + step) % len(self._points)]
            if replica not in allowed:
                continue
            first = replica if first is None else first
            if view.load(replica) + 1 <= bound:
                return Decision(replica, reason="session")
        return Decision(first, reason="session")


class RoutedIndex:
    """Per replica, the block hashes recently routed there: the router's prediction of what each one caches,
    when it reads no events. LRU and capped, like the pools it guesses at (a replica evicts too).

    With tiers (``media``, as the replica's hello announces them): a replica with a disk keeps a pool's worth of
    blocks in its pool part, and what falls out of it goes to its disk part (as the engine's pool evicts a block
    its disk still holds), up to the disk's capacity; a replica restarted or reset keeps its disk part and gets its
    pool part added to it. Every block routed to a replica that reads a shared tier is in that tier's part, one per
    store, which every replica reading it is credited with."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the routed-prefix index needs at least one block per replica, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._replicas: dict[int, OrderedDict[Hashable, None]] = {}
        self._disks: dict[int, _Recent] = {}
        self._shared: dict[str, _Recent] = {}

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        held = self._replicas.get(replica)
        return leading_blocks_in(held, block_hashes, prefix_closed=True) if held else 0

    def held(self, replica: int, block_hashes: Sequence[Hashable], media: Mapping[str, Medium]) -> Held:
        disk = self._disks.get(replica)
        shared = self._shared.get(media[SHARED].store) if SHARED in media else None
        return held_below(self.cached_prefix_blocks(replica, block_hashes), block_hashes, media,
                          None if disk is None else disk.blocks, None if shared is None else shared.blocks)

    def record(self, replica: int, block_hashes: Sequence[Hashable], media: Mapping[str, Medium] = NO_TIERS) -> None:
        held = self._replicas.setdefault(replica, OrderedDict())
        _refresh(held, block_hashes)
        capacity = self.capacity_blocks
        disk = None
        if DISK in media:
            disk = self._disks.get(replica)
            if disk is None:
                disk = self._disks[replica] = _Recent(media[DISK].capacity_blocks or self.capacity_blocks)
            capacity = media[POOL].capacity_blocks if POOL in media and media[POOL].capacity_blocks else capacity
        while len(held) > capacity:
            evicted = held.popitem(last=False)[0]
            if disk is not None:
                disk.add([evicted])
        if SHARED in media:
            store = media[SHARED].store
            shared = self._shared.get(store)
            if shared is None:
                shared = self._shared[store] = _Recent(media[SHARED].capacity_blocks or self.capacity_blocks)
            shared.add(block_hashes)

    def forget(self, replica: int) -> None:
        """The replica restarted or was reset: its pool holds nothing we sent it; its disk holds what it did."""
        held = self._replicas.pop(replica, None)
        disk = self._disks.get(replica)
        if held and disk is not None:
            disk.add(list(held))


def _refresh(held: OrderedDict[Hashable, None], block_hashes: Sequence[Hashable]) -> None:
    """Makes ``block_hashes`` the most recent in ``held``, deepest block first, so a prefix's first blocks are the
    most recent and eviction eats it from its end: what stays is still a prefix (evicting the first block would
    lose the credit for all the others), and what the index holds is prefix-closed (``cache.leading_blocks_in``)."""
    move = held.move_to_end
    for h in reversed(block_hashes):
        try:
            move(h)  # most blocks of a request were routed before: one operation, not a store and a move
        except KeyError:
            held[h] = None  # a new one goes in last, as a move would have put it


class _Recent:
    """At most ``capacity`` block hashes, the least recently added dropped first (a tier's part of the index)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, block_hashes: Sequence[Hashable]) -> None:
        _refresh(self.blocks, block_hashes)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


# What one request in flight adds to the wait of a request routed behind it, in blocks of prefill: the decode steps
# it shares with the newcomer's prefill. A step of a small decode batch costs about what prefilling one block does,
# and a replica's own queue of prefill is counted block by block (``queued_prefill_blocks``).
DECODE_BLOCKS_PER_REQUEST = 1.0


class PrefixScore:
    """The replica where this request's first token comes soonest: the least work ahead plus its own.

    A replica's cost, in blocks of prefill (prefill time grows with the blocks computed): the prefill it has
    queued (prompt blocks routed there, not credited as cached, whose first token is not out yet), the decode work
    of the requests it runs (``DECODE_BLOCKS_PER_REQUEST`` each), and the blocks of this request it would have to
    compute. The least cost wins. So a prefix stays on the replica that holds it until the wait there costs more
    than computing the prefix elsewhere, and only then spreads, as NVIDIA Dynamo's KV router weighs potential
    prefill blocks against active decode work; an idle fleet never spreads a prefix (every spread is a prefix
    computed again). Requests in flight are also bounded, as SGLang's cache-aware router falls back to the
    shortest queue when the fleet is out of balance: a replica above ``load_cap`` x the mean (+ 1) is passed over
    however much it caches. A computed block weighs 1 + the mean requests in flight per replica: on a busy fleet
    every block computed again is throughput the others wait on. A request cached nowhere for at least half its
    blocks is placed as a new prefix (as SGLang's router sends a request under its cache threshold to the
    replica with the most room): among the least loaded replicas, the next in rotation, so new prefixes and the
    long branches of a short shared start spread evenly over the pools. Equal cost: the larger credit, then fewer
    requests in flight, then a seeded coin.

    Below the pool: a block the replica would load from its disk, or from a shared tier any replica reading it can
    load from, is credited as a block of prefill less what loading it costs there (``Held.credit``; the replica
    measures the cost and announces it): below a block in its pool, above a miss. So a hot prefix in the shared
    tier spreads by load alone, loaded where it goes instead of computed again.

    Two sources of "cached": ``prefix`` remembers where it routed each block (``RoutedIndex``: approximate, no
    events needed); ``kv-events`` asks the view, which holds each replica's exact sets (the router's event-fed
    mirrors, the planner's pools and tiers).
    """

    def __init__(self, name: str, load_cap: float = 1.25, seed: int = 0, routed: RoutedIndex | None = None):
        if load_cap < 1.0:
            raise ValueError(f"load_cap must be >= 1.0, got {load_cap}")
        self.name = name
        self.load_cap = load_cap
        self._routed = routed
        self.reads_cache = routed is None
        self._rng = random.Random(seed)
        self._next = 0  # where the rotation of new prefixes continues

    def held(self, replica: int, request: Routable, view: ReplicaView) -> Held:
        if self._routed is not None:
            return self._routed.held(replica, request.block_hashes, view.media(replica))
        return view.held_prefix(replica, request.block_hashes)

    def forget(self, replica: int) -> None:
        if self._routed is not None:
            self._routed.forget(replica)

    def _rotation(self, ties: list[int], view: ReplicaView) -> int:
        """The next of ``ties`` in rotation, so that new prefixes on an idle fleet spread evenly over the pools
        instead of by chance (three on one pool may not fit)."""
        replica = min(ties, key=lambda r: (r - self._next) % view.num_replicas)
        self._next = replica + 1
        return replica

    def choose(self, request: Routable, view: ReplicaView) -> Decision:
        up = candidates(view)
        # Not overloaded: at most load_cap x the mean (+1, so an idle fleet admits anyone); the least loaded
        # replica always qualifies.
        loads = {r: view.load(r) for r in up}
        limit = self.load_cap * sum(loads.values()) / len(up) + 1
        eligible = [r for r in up if loads[r] <= limit]
        held = {r: self.held(r, request, view) for r in eligible} if request.block_hashes else {}
        size = max(request.num_blocks, len(request.block_hashes))
        # A request that computes most of its prompt wherever it goes is placed as a new prefix: where its new
        # blocks spread the pools evenly, not next to a short shared start (one pool would hold every branch).
        new = 2 * max((h.blocks for h in held.values()), default=0) < size
        weighed = {} if new else {r: h.credit for r, h in held.items()}
        # A block computed again costs this request its time, and on a busy fleet also the throughput the requests
        # in flight wait on: weighed 1 + the mean requests in flight per replica.
        weight = 1 + sum(loads.values()) / len(up)
        cost = {r: view.queued_prefill_blocks(r) + DECODE_BLOCKS_PER_REQUEST * loads[r]
                + weight * (size - weighed.get(r, 0)) for r in eligible}
        low = min(cost.values())
        ties = [r for r in eligible if cost[r] == low]
        best = max(weighed.get(r, 0) for r in ties)
        ties = [r for r in ties if weighed.get(r, 0) == best]
        replica = self._rotation(ties, view) if best == 0 else least_loaded(ties, view, self._rng)
        chosen = held.get(replica, NOT_HELD)
        if self._routed is not None:
            self._routed.record(replica, request.block_hashes, view.media(replica))
        return Decision(replica, chosen.blocks, "cached_prefix" if chosen.blocks else "no_prefix",
                        load_cost=chosen.load_cost)


# A predicted index this large costs a few tens of MB per replica at most and outlives typical pools.
DEFAULT_ROUTED_BLOCKS = 1 << 18

# name -> factory(seed, load_cap); policies keep state, so each replay (and each router) builds its own.
POLICIES: dict[str, Callable[[int, float], RoutingPolicy]] = {
    RoundRobin.name: lambda seed, load_cap: RoundRobin(),
    RandomChoice.name: lambda seed, load_cap: RandomChoice(seed),
    LeastLoad.name: lambda seed, load_cap: LeastLoad(seed),
    SessionAffinity.name: lambda seed, load_cap: SessionAffinity(load_cap, seed),
    "prefix": lambda seed, load_cap: PrefixScore("prefix", load_cap, seed, RoutedIndex(DEFAULT_ROUTED_BLOCKS)),
    "kv-events": lambda seed, load_cap: PrefixScore("kv-events", load_cap, seed),
}


def make_policy(name: str, seed: int = 0, load_cap: float = 1.25) -> RoutingPolicy:
    """A fresh policy by name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory(seed, load_cap)

