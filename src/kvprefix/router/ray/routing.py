"""Routing on Ray Serve: the ledger over Ray's engine replicas, and Ray's request router that asks it.

Ray runs a handle's request router in the process of the caller, the ingress, on a loop of its own. The ingress
owns the ``RayRouting`` (the policy's ``Ledger``, the replicas' fixed positions, the metrics); the request router
finds it through the ingress replica's context (``servable_object``) and only hands it Ray's calls. So a decision
is counted where it is made, and the request the ingress sends (``RouteRequest``) is never written to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvprefix.cache.media import POOL
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest
from kvprefix.router.ledger import Ledger
from kvprefix.router.metrics import RouterMetrics
from kvprefix.router.pending import Routed
from kvprefix.router.policies import Decision, RoutingPolicy


class ReplicaSlots:
    """The engine replicas at fixed policy positions, each with its ``Replica`` (its load, its metrics' name).

    The session ring and the routed-prefix index are keyed by position, and Ray's replica ids change on every
    restart: the first replicas fill positions in replica-id order, a new one takes the first position a gone one
    left, which the ledger forgets. ``resets`` are (replica id, how many times its cache was reset through the
    ingress so far): every call carries them, and each reset is forgotten once, by the first call that brings it
    (a request Ray asks about again, or the calls after it, forget nothing more)."""

    def __init__(self, ledger: Ledger, replica: Callable[[str], Replica]):
        self.ledger = ledger
        self._replica = replica  # the ingress's Replica of a replica id (created on first sight)
        self.slots: list[ReplicaID | None] = []
        self.replicas: dict[ReplicaID, Replica] = {}
        self._resets_applied: dict[str, int] = {}

    def place(self, up: set[ReplicaID], resets: Sequence[tuple[str, int]] = ()) -> None:
        for replica_id, count in resets:
            if count <= self._resets_applied.get(replica_id, 0):
                continue
            self._resets_applied[replica_id] = count
            for i, rid in enumerate(self.slots):
                if rid is not None and rid.unique_id == replica_id:
                    self.ledger.forget(i)
        self.slots = [s if s in up else None for s in self.slots]
        for rid in sorted(up - set(self.slots), key=lambda r: r.unique_id):
            self.replicas[rid] = self._replica(rid.unique_id)
            if None in self.slots:
                i = self.slots.index(None)
                self.slots[i] = rid
                self.ledger.forget(i)
            else:
                self.slots.append(rid)

    def view(self, route: RouteRequest) -> FleetView:
        """The policy's view: a position is healthy while Ray offers its replica; what a replica holds, in its pool
        and its tiers, is what the ingress found of this request in the event streams (kv-events); where it holds
        blocks is what its hello said (``Replica.media`` of the ingress's replica)."""
        held = route.held or {}
        replicas = []
        for rid in self.slots:
            if rid is None:
                replicas.append(Replica("", False))
                continue
            rep, mine = self.replicas[rid], dict(held.get(rid.unique_id, {}))
            replicas.append(Replica(rid.unique_id, True, outstanding=rep.outstanding, cached=mine.pop(POOL, None),
                                    tier_cached=mine, media_info=rep.media))
        return FleetView(replicas)


class RayRouting:
    """Route and account for one ingress: Ray asks ``choose`` (again, when the replica it chose refused the request:
    full), tells ``routed`` where the request went and ``completed`` when it ended."""

    def __init__(self, policy: RoutingPolicy, metrics: RouterMetrics, replica: Callable[[str], Replica]):
        self.ledger = Ledger(policy)
        self.placement = ReplicaSlots(self.ledger, replica)
        self.metrics = metrics
        self._replica = replica
        self.block_size = 0  # tokens per block, once the ingress knows the block identity (the predicted metric)
        # request id -> (route, decision, replica chosen), until Ray says where it went
        self._chosen: dict[str, tuple[RouteRequest, Decision, ReplicaID | None]] = {}
        self._routed: dict[str, Routed] = {}  # request id -> its share of the replica's load, until it completes

    def choose(self, request_id: str, route: RouteRequest, up: set[ReplicaID]) -> ReplicaID | None:
        placement = self.placement
        earlier = self._chosen.get(request_id)  # asked again: the replica chosen before refused it (full)
        refused = () if earlier is None else (*earlier[1].refused, *([earlier[2].unique_id] if earlier[2] else []))
        decision = self.ledger.choose(route, placement.view(route), refused)
        chosen = placement.slots[decision.replica]
        chosen = chosen if chosen in up else None
        self._chosen[request_id] = route, decision, chosen
        return chosen

    def routed(self, request_id: str, replica_id: ReplicaID) -> None:
        chosen = self._chosen.pop(request_id, None)
        if chosen is None:
            return
        route, decision, _ = chosen
        rep = self.placement.replicas.get(replica_id) or self._replica(replica_id.unique_id)
        self.metrics.series[rep.name].count(decision, self.block_size)
        for other in decision.refused:
            self.metrics.series[self._replica(other).name].retries.inc()
        # Ray tells no first token: a request's prefill counts as queued until it completes.
        self._routed[request_id] = self.ledger.record(route, decision, rep.outstanding)

    def completed(self, request_id: str) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            routed.finish()


class PolicyRequestRouter(RequestRouter):
    """Ray Serve request router of the engine deployment. A call with a ``route`` goes where the ingress's
    ``RayRouting`` chooses; with ``exclude=ids``, to a replica whose id is not among them (the ingress follows each
    replica's event stream once, and fans admin calls out to every one; while Ray knows no other replica yet,
    any); with neither, to any replica. ``forget=((id, resets), ...)``: the replicas whose cache was reset through
    the ingress, and how often; applied before the call is placed, as `kvprefix route` forgets a replica it reset."""

    def initialize_state(self, **kwargs) -> None:
        self._routing: RayRouting | None = None
        self._lock = threading.Lock()

    def routing(self) -> RayRouting | None:
        """The ingress's ``RayRouting``; None until the ingress has started (its own calls carry no route)."""
        if self._routing is None:
            with self._lock:
                ingress = serve.get_replica_context().servable_object
                self._routing = getattr(ingress, "routing", None)
        return self._routing

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        exclude, route = kwargs.get("exclude"), kwargs.get("route")
        if exclude is not None:  # a replica the caller has not reached yet; none: any (the ingress sees the repeat)
            others = [r for r in candidate_replicas if r.replica_id.unique_id not in exclude]
            return [others or candidate_replicas]
        routing = self.routing() if route is not None else None
        if routing is None:  # not a client request (the block identity, a health probe): any replica
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        routing.placement.place(set(by_id), kwargs.get("forget") or ())
        chosen = routing.choose(pending_request.metadata.internal_request_id, route, set(by_id))
        return [[by_id[chosen]]] if chosen is not None else [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if self._routing is not None:
            self._routing.routed(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routing is not None:
            self._routing.completed(internal_request_id)
