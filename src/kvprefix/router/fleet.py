"""The replicas as routing sees them, and the one ``ReplicaView`` over them (``FleetView``).

A replica's load is what was routed there and has not finished (``Outstanding``: requests in flight, their queued
prefill, their blocks). What it caches is one count everywhere: the blocks of requests in flight there, then the
blocks its pool holds (``PendingBlocks.cached_prefix_blocks``), then those on its disk, then those in a shared tier
it reads (``policies.held_below``). What it holds is its exact set per medium where the router knows it: a KV event
stream's ``StreamMirror`` (`kvprefix route`; the shared tier's blocks are those any replica reading the same store
announced), the pool and tiers themselves (the planner), the request's own blocks that a replica's mirror holds
(the Ray ingress hands them over with the request). Pure state.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from kvprefix.cache.event_index import StreamMirror
from kvprefix.cache.media import DISK, SHARED, Medium
from kvprefix.router.pending import Outstanding
from kvprefix.router.policies import Held, held_below


@dataclass
class Replica:
    name: str  # a URL (`kvprefix route`), a Ray replica id, a position (the planner)
    healthy: bool = False  # until the first health check answers
    mirror: StreamMirror | None = None  # only when following KV events
    outstanding: Outstanding = field(default_factory=Outstanding)
    resyncs: int = 0  # snapshots applied: the first, then one per restart or lost stream
    cached: Container[Hashable] | None = None  # what its pool holds, where the router has that directly (not a mirror)
    tier_cached: dict[str, Container[Hashable]] = field(default_factory=dict)  # the same for its tiers, by medium
    media_info: Mapping[str, Medium] = field(default_factory=dict)  # where it holds blocks, where no stream says

    @property
    def in_flight(self) -> int:
        return self.outstanding.requests

    @property
    def held(self) -> Container[Hashable] | None:
        """The blocks the replica holds, None while unknown (no stream followed, or not synced yet)."""
        mirror = self.mirror
        if mirror is not None:
            return mirror.index if mirror.ready else None
        return self.cached

    @property
    def media(self) -> Mapping[str, Medium]:
        """Where it holds blocks, with capacities and load costs: its stream's hello (and later load costs), else
        ``media_info``."""
        mirror = self.mirror
        return mirror.media if mirror is not None and mirror.media else self.media_info

    def held_in(self, medium: str) -> Container[Hashable] | None:
        """The blocks it holds in a tier (``cache.media``), None while unknown."""
        mirror = self.mirror
        if mirror is not None:
            return mirror.blocks.of(medium) if mirror.ready else None
        return self.tier_cached.get(medium)


class AnyOf:
    """The union of some containers, without copying them."""

    def __init__(self, parts: list[Container[Hashable]]):
        self.parts = parts

    def __contains__(self, item: object) -> bool:
        return any(item in part for part in self.parts)


class FleetView:
    """``ReplicaView`` over replicas; ``excluding`` gives the same view without replicas that already failed this
    request (a retry goes elsewhere)."""

    def __init__(self, replicas: list[Replica], excluded: frozenset[int] = frozenset()):
        self.replicas = replicas
        self.num_replicas = len(replicas)
        self._excluded = excluded

    def excluding(self, replica: int) -> FleetView:
        return FleetView(self.replicas, self._excluded | {replica})

    def excluded_names(self) -> tuple[str, ...]:
        if not self._excluded:  # the first attempt of every request: no generator, no sort
            return ()
        return tuple(self.replicas[r].name for r in sorted(self._excluded))

    def usable(self) -> bool:
        excluded = self._excluded
        return any(rep.healthy and r not in excluded for r, rep in enumerate(self.replicas))

    def healthy(self, replica: int) -> bool:
        return replica not in self._excluded and self.replicas[replica].healthy

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        """The leading blocks in its pool, or being computed there for a request routed before."""
        rep = self.replicas[replica]
        return rep.outstanding.blocks.cached_prefix_blocks(block_hashes, rep.held)

    def held_prefix(self, replica: int, block_hashes: Sequence[Hashable]) -> Held:
        rep = self.replicas[replica]
        pool, media = self.cached_prefix_blocks(replica, block_hashes), rep.media
        if DISK not in media and SHARED not in media:
            return Held(pool)  # no tier: the pool's count, as before tiers (the router's hot path)
        return held_below(pool, block_hashes, media, rep.held_in(DISK),
                          self.shared_held(rep, media[SHARED].store) if SHARED in media else None)

    def shared_held(self, rep: Replica, store: str) -> Container[Hashable] | None:
        """The blocks in the shared tier ``store``, which ``rep`` reads: those any replica reading it announced (the
        union of their mirrors), else what the router has directly."""
        if rep.mirror is None:
            return rep.tier_cached.get(SHARED)
        return AnyOf([r.mirror.blocks.of(SHARED) for r in self.replicas
                      if r.mirror is not None and r.mirror.ready and SHARED in r.mirror.media
                      and r.mirror.media[SHARED].store == store])

    def media(self, replica: int) -> Mapping[str, Medium]:
        return self.replicas[replica].media

    def load(self, replica: int) -> float:
        return self.replicas[replica].outstanding.requests

    def queued_prefill_blocks(self, replica: int) -> float:
        return self.replicas[replica].outstanding.queued_prefill_blocks

    def imbalance(self) -> float:
        """Busiest replica's requests in flight / the mean (1.0 = even; 1.0 when idle)."""
        loads = [r.in_flight for r in self.replicas]
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 1.0
