"""The router's replicas and its ``ReplicaView`` of them: health, requests in flight, and what each caches.

"Cached" is the replica's exact set from its KV event stream (``StreamMirror``, when the router follows the
streams) plus the blocks of requests routed there and still running. Load is what this router sent there and has
not finished (``Outstanding``: requests in flight, and their queued prefill). Pure state: the HTTP side
(``router.app``, ``router.events``) updates it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvprefix.cache.event_index import StreamMirror
from kvprefix.router.pending import Outstanding


@dataclass
class Replica:
    url: str
    healthy: bool = False  # until the first health check answers
    mirror: StreamMirror | None = None  # only when following KV events
    outstanding: Outstanding = field(default_factory=Outstanding)
    resyncs: int = 0  # snapshots applied: the first, then one per restart or lost stream

    @property
    def name(self) -> str:
        return self.url

    @property
    def in_flight(self) -> int:
        return self.outstanding.requests


class FleetView:
    """``ReplicaView`` over the fleet; ``excluding`` gives the same view without replicas that already failed
    this request (a retry goes elsewhere)."""

    def __init__(self, replicas: list[Replica], excluded: frozenset[int] = frozenset()):
        self.replicas = replicas
        self.num_replicas = len(replicas)
        self._excluded = excluded

    def excluding(self, replica: int) -> FleetView:
        return FleetView(self.replicas, self._excluded | {replica})

    def usable(self) -> bool:
        excluded = self._excluded
        return any(rep.healthy and r not in excluded for r, rep in enumerate(self.replicas))

    def healthy(self, replica: int) -> bool:
        return replica not in self._excluded and self.replicas[replica].healthy

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        rep = self.replicas[replica]
        held = rep.mirror.index if rep.mirror is not None and rep.mirror.ready else None
        return rep.outstanding.blocks.cached_prefix_blocks(block_hashes, held)

    def load(self, replica: int) -> float:
        return self.replicas[replica].outstanding.requests

    def queued_prefill_blocks(self, replica: int) -> float:
        return self.replicas[replica].outstanding.queued_prefill_blocks

    def imbalance(self) -> float:
        """Busiest replica's requests in flight / the mean (1.0 = even; 1.0 when idle)."""
        loads = [r.in_flight for r in self.replicas]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0
