"""The router's Prometheus metrics (docs/router.md): one registry per router, no global state."""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.policies import REASONS, Decision

P = "kvprefix:router_"
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
TAIL_BYTES = 4096  # usage comes last in a body or stream: enough of the end to find it


def reported_cached_tokens(tail: bytes) -> int | None:
    """``cached_tokens`` of an answer, from its last ``TAIL_BYTES`` (a body or a stream's final usage)."""
    found = _CACHED_TOKENS.findall(tail)
    return int(found[-1]) if found else None


@dataclass(frozen=True)
class ReplicaSeries:
    """One replica's counters, looked up once: ``labels()`` on every request costs more than the rest of the
    bookkeeping."""

    requests: dict[str, Counter]  # by decision reason (REASONS)
    predicted_cached: Counter
    reported_cached: Counter
    retries: Counter
    resyncs: Counter

    def count(self, decision: Decision, block_size: int) -> None:
        """A request this replica took: by why it was chosen, and the tokens the decision credited there."""
        self.requests[decision.reason].inc()
        if decision.credited:
            self.predicted_cached.inc(decision.credited * block_size)


class RouterMetrics:
    def __init__(self, view: FleetView):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "requests", "Requests sent to each replica, by decision reason",
                                ["replica", "reason"], registry=r)
        self.predicted_cached = Counter(P + "predicted_cached_tokens", "Prompt tokens the policy expected cached "
                                        "at the replica it chose", ["replica"], registry=r)
        self.reported_cached = Counter(P + "reported_cached_tokens", "usage.prompt_tokens_details.cached_tokens "
                                       "the replicas reported", ["replica"], registry=r)
        self.retries = Counter(P + "retries", "Requests retried elsewhere after this replica failed before "
                               "answering", ["replica"], registry=r)
        self.resyncs = Counter(P + "kv_events_resyncs", "KV event snapshots applied (first sync, restarts, lost "
                               "streams)", ["replica"], registry=r)
        self.unroutable = Counter(P + "unroutable", "Requests refused with 503: no replica could take them",
                                  registry=r)
        self._in_flight = Gauge(P + "requests_in_flight", "Requests in flight through the router", ["replica"],
                                registry=r)
        self._queued = Gauge(P + "queued_prefill_blocks", "Prompt blocks routed to the replica, not credited as "
                             "cached, whose first token is not out yet", ["replica"], registry=r)
        self._healthy = Gauge(P + "replica_healthy", "1 while the replica passes health checks", ["replica"],
                              registry=r)
        self._blocks = Gauge(P + "kv_events_blocks", "Blocks the replica caches, as its event stream says (-1: not "
                             "synced)", ["replica"], registry=r)
        imbalance = Gauge(P + "load_imbalance", "Busiest replica's requests in flight / the mean", registry=r)
        imbalance.set_function(view.imbalance)
        self.series: dict[str, ReplicaSeries] = {}  # by replica name
        for rep in view.replicas:
            self.add_replica(rep)

    def add_replica(self, rep: Replica) -> ReplicaSeries:
        """Every series of a replica, from zero (the Ray ingress learns its replicas as they answer)."""
        name = rep.name
        self._in_flight.labels(name).set_function(lambda: rep.in_flight)
        self._queued.labels(name).set_function(lambda: rep.outstanding.queued_prefill_blocks)
        self._healthy.labels(name).set_function(lambda: float(rep.healthy))
        self._blocks.labels(name).set_function(
            lambda: len(rep.mirror.index) if rep.mirror is not None and rep.mirror.ready else -1)
        series = self.series[name] = ReplicaSeries(
            {reason: self.requests.labels(name, reason) for reason in REASONS}, self.predicted_cached.labels(name),
            self.reported_cached.labels(name), self.retries.labels(name), self.resyncs.labels(name))
        return series

    def render(self) -> bytes:
        return generate_latest(self.registry)
