"""Routing policies: which replica serves a request.

A policy sees a request (its block hashes and session key) and a ``ReplicaView`` of the replicas (cached prefix
length and load). The planner implements the view with real ``KVCacheManager``s; an HTTP router implements it
with an index fed by KV cache events. The same policy objects serve both.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import xxhash


class Routable(Protocol):
    """What a policy reads from a request: full-block hashes (chained) and an optional session key."""

    block_hashes: Sequence[Hashable]
    session: Hashable | None


class ReplicaView(Protocol):
    num_replicas: int

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of ``block_hashes`` the replica holds."""
        ...

    def load(self, replica: int) -> float:
        """The replica's current load, in the view's unit (requests in flight, for instance)."""
        ...


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: Routable, view: ReplicaView) -> int: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Routable, view: ReplicaView) -> int:
        replica = self._next % view.num_replicas
        self._next = replica + 1
        return replica


class RandomChoice:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: Routable, view: ReplicaView) -> int:
        return self._rng.randrange(view.num_replicas)


def _stable_hash(key: Hashable) -> int:
    # Python's hash() is salted per process; a router fleet must agree on placement.
    return xxhash.xxh64_intdigest(repr(key).encode())


class ConsistentHash:
    """Session affinity on a hash ring: a session (else the request's first block) always lands on the same
    replica, and adding a replica moves only about 1/N of the keys."""

    name = "consistent-hash"

    def __init__(self, virtual_nodes: int = 64) -> None:
        self.virtual_nodes = virtual_nodes
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

    def choose(self, request: Routable, view: ReplicaView) -> int:
        if view.num_replicas != self._ring_size:
            self._build(view.num_replicas)
        if request.session is not None:
            key = request.session
        elif request.block_hashes:
            key = request.block_hashes[0]
        else:
            key = None
        i = bisect.bisect(self._points, _stable_hash(key)) % len(self._points)
        return self._owners[i]


class PrefixAffinity:
    """Longest cached prefix wins, among replicas not overloaded.

    A replica is eligible while its load is at most ``load_cap`` x the mean load (+1, so an idle fleet admits
    anyone); the least loaded replica is always eligible. Ties go to the less loaded, then the lower index.
    """

    name = "prefix-affinity"

    def __init__(self, load_cap: float = 1.25) -> None:
        if load_cap < 1.0:
            raise ValueError(f"load_cap must be >= 1.0, got {load_cap}")
        self.load_cap = load_cap

    def choose(self, request: Routable, view: ReplicaView) -> int:
        n = view.num_replicas
        loads = [view.load(r) for r in range(n)]
        limit = self.load_cap * sum(loads) / n + 1
        best, best_key = 0, None
        for r in range(n):
            if loads[r] > limit:
                continue
            key = (view.cached_prefix_blocks(r, request.block_hashes), -loads[r])
            if best_key is None or key > best_key:
                best, best_key = r, key
        return best


# name -> factory(seed, load_cap); policies keep state, so each replay builds its own.
POLICIES: dict[str, Callable[[int, float], RoutingPolicy]] = {
    RoundRobin.name: lambda seed, load_cap: RoundRobin(),
    RandomChoice.name: lambda seed, load_cap: RandomChoice(seed),
    ConsistentHash.name: lambda seed, load_cap: ConsistentHash(),
    PrefixAffinity.name: lambda seed, load_cap: PrefixAffinity(load_cap),
}


def make_policy(name: str, seed: int = 0, load_cap: float = 1.25) -> RoutingPolicy:
    """A fresh policy by name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory(seed, load_cap)
