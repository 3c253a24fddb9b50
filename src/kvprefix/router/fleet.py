"""The replicas as routing sees them, and the one ``ReplicaView`` over them (``FleetView``).

A replica's load is what was routed there and has not finished (``Outstanding``: requests in flight, their queued
prefill, their blocks). What it caches is one count everywhere: the blocks of requests in flight there, then the
blocks it holds (``PendingBlocks.cached_prefix_blocks``). What it holds is its exact set where the router knows
it: a KV event stream's ``StreamMirror`` (`kvprefix route`), the pool itself (the planner), the request's own
blocks that a replica's mirror holds (the Ray ingress hands them over with the request). Pure state.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field

from kvprefix.cache.event_index import StreamMirror
from kvprefix.router.pending import Outstanding


@dataclass
class Replica:
    name: str  # a URL (`kvprefix route`), a Ray replica id, a position (the planner)
    healthy: bool = False  # until the first health check answers
    mirror: StreamMirror | None = None  # only when following KV events
    outstanding: Outstanding = field(default_factory=Outstanding)
    resyncs: int = 0  # snapshots applied: the first, then one per restart or lost stream
    cached: Container[Hashable] | None = None  # what it holds, where the router has that directly (not a mirror)

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
        rep = self.replicas[replica]
        return rep.outstanding.blocks.cached_prefix_blocks(block_hashes, rep.held)

    def load(self, replica: int) -> float:
        return self.replicas[replica].outstanding.requests

    def queued_prefill_blocks(self, replica: int) -> float:
        return self.replicas[replica].outstanding.queued_prefill_blocks

    def imbalance(self) -> float:
        """Busiest replica's requests in flight / the mean (1.0 = even; 1.0 when idle)."""
        loads = [r.in_flight for r in self.replicas]
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 1.0
