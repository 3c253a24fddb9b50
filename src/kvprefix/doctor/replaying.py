"""Replays a variant of the log through the planner (``kvprefix.sim.replay``: the real KV cache manager), in log
order, on one replica or on the replicas the log names, and removes the hits the log's timing rules out."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvprefix.doctor.chains import TraceView, Variant
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace

# Prefill speed assumed for logs that give arrival times but no durations (the planner's default).
PREFILL_TOKENS_PER_S = 10_000.0


@dataclass(frozen=True)
class Setting:
    """How one replay runs: ``capacity_blocks`` None = nothing is ever evicted."""

    capacity_blocks: int | None
    per_replica: bool  # each request on the replica the log names (its own pool) instead of one replica
    in_flight: bool  # a block still being computed by an earlier request cannot be hit yet


@dataclass(frozen=True)
class Timing:
    """Arrival and prefill duration per request (log order); None where the log gives no times."""

    arrival: Sequence[float] | None
    prefill_s: Sequence[float | None] | None


class Replayer:
    """Replays variants of one log; the replay behind two settings that differ only in ``in_flight`` runs once."""

    def __init__(self, order: Sequence[int], groups: list[list[int]], timing: Timing):
        self.order = order  # all requests in arrival order
        self.groups = groups  # the same per replica
        self.timing = timing
        self._raw: dict[tuple, array] = {}

    def cached_tokens(self, variant: Variant, setting: Setting) -> array:
        """Cached prompt tokens per request (log order)."""
        key = (variant.name, setting.capacity_blocks, setting.per_replica)
        raw = self._raw.get(key)
        if raw is None:
            raw = self._raw[key] = self._replay(variant, setting)
        cached = array("q", raw)
        if setting.in_flight and self.timing.arrival is not None:
            _drop_in_flight_hits(variant, self.order, cached, self.timing)
        return cached

    def _replay(self, variant: Variant, setting: Setting) -> array:
        bs = variant.block_size
        cached = array("q", bytes(8 * len(variant)))
        for members in self.groups if setting.per_replica else [self.order]:
            capacity = setting.capacity_blocks or _distinct_blocks(variant, members) + variant.max_blocks + 1
            trace = Trace(variant.name, bs, TraceView(variant, members))  # type: ignore[arg-type]
            rec = replay(trace, ReplayConfig(capacity_blocks=capacity, mode="order"))
            for i, blocks in zip(members, rec.cached_blocks, strict=True):
                cached[i] = blocks * bs
        return cached


def _distinct_blocks(variant: Variant, members: Sequence[int]) -> int:
    """The distinct full blocks of some requests: a pool of that many (plus one request's) never evicts."""
    seen = bytearray(len(variant.tree))
    parent = variant.tree.parent
    n = 0
    for i in members:
        node = variant.leaves[i]
        while node >= 0 and not seen[node]:
            seen[node] = 1
            n += 1
            node = parent[node]
    return n


def _drop_in_flight_hits(variant: Variant, order: Sequence[int], cached: array, timing: Timing) -> None:
    """A block is ready when the first request that computed it finished its prefill; a request arriving before
    that recomputes it (and everything after it), whatever the replay found in the pool."""
    bs, tree = variant.block_size, variant.tree
    ready: dict[int, float] = {}
    for i in order:
        t = timing.arrival[i]
        chain = tree.chain(variant.leaves[i])
        hit = cached[i] // bs
        for b in range(hit):
            if ready.get(chain[b], t) > t:
                hit = b
                break
        cached[i] = hit * bs
        logged = timing.prefill_s[i] if timing.prefill_s is not None else None
        done = t + (logged if logged is not None else (variant.tokens[i] - hit * bs) / PREFILL_TOKENS_PER_S)
        for node in chain[hit:]:
            if node not in ready or ready[node] > done:
                ready[node] = done
