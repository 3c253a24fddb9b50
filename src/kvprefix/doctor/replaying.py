"""Replays a variant of the log through the planner (the real KV cache manager), in log order, on one replica or
the replicas the log names, and removes the hits the log's timing rules out. Unbounded capacity skips the pool
(``unbounded_replay``, tested equal)."""

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
    """How one replay runs: ``capacity_blocks`` in blocks of the log's block size (a variant at another block size
    gets as many tokens), None = nothing is ever evicted."""

    capacity_blocks: int | None
    per_replica: bool  # each request on the replica the log names (its own pool) instead of one replica
    in_flight: bool  # a block still being computed by an earlier request cannot be hit yet
    disk_bytes: int | None = None  # a disk tier of this many bytes below each pool (the planner's; bounded pools)


@dataclass(frozen=True)
class Timing:
    """Arrival and prefill duration per request (log order); None where the log gives no times."""

    arrival: Sequence[float] | None
    prefill_s: Sequence[float | None] | None


class Replayer:
    """Replays variants of one log, each distinct replay once: a replay is a function of the requests' chains and
    lengths (``in_flight`` is applied after it)."""

    def __init__(self, order: Sequence[int], groups: list[list[int]], timing: Timing, block_size: int):
        self.order = order  # all requests in arrival order
        self.groups = groups  # the same per replica
        self.timing = timing
        self.block_size = block_size  # the log's: what ``Setting.capacity_blocks`` counts in
        self._raw: dict[tuple, array] = {}

    def cached_tokens(self, variant: Variant, setting: Setting) -> array:
        """Cached prompt tokens per request (log order)."""
        key = (_content_key(variant), setting.capacity_blocks, setting.per_replica, setting.disk_bytes)
        raw = self._raw.get(key)
        if raw is None:
            raw = self._raw[key] = self._replay(variant, setting)
        cached = array("q", raw)
        if setting.in_flight and self.timing.arrival is not None:
            _drop_in_flight_hits(variant, self.order, cached, self.timing)
        return cached

    def _replay(self, variant: Variant, setting: Setting) -> array:
        cached = array("q", bytes(8 * len(variant)))
        for members in self.groups if setting.per_replica else [self.order]:
            if setting.capacity_blocks is None:
                unbounded_replay(variant, members, cached)
            else:
                capacity = setting.capacity_blocks * self.block_size // variant.block_size
                planner_replay(variant, members, capacity, cached, setting.disk_bytes)
        return cached


def _content_key(variant: Variant) -> tuple:
    """Equal for two variants of the same tree with the same chains and lengths, in the same block size."""
    return variant.block_size, variant.leaves.tobytes(), variant.tokens.tobytes()


def planner_replay(variant: Variant, members: Sequence[int], capacity_blocks: int, cached: array,
                   disk_bytes: int | None = None) -> None:
    """Sets ``cached[i]``, for each request of ``members`` replayed in that order through the planner (one pool of
    ``capacity_blocks``, with a disk tier of ``disk_bytes`` below it if given), to the tokens its caches served."""
    bs = variant.block_size
    trace = Trace(variant.name, bs, TraceView(variant, members))  # type: ignore[arg-type]
    rec = replay(trace, ReplayConfig(capacity_blocks=capacity_blocks, mode="order", disk_capacity_bytes=disk_bytes))
    for i, blocks in zip(members, rec.cached_blocks, strict=True):
        cached[i] = blocks * bs


def unbounded_replay(variant: Variant, members: Sequence[int], cached: array) -> None:
    """``planner_replay`` with a pool that never evicts, without the pool: a request hits the blocks of its chain
    seen before (a prefix: a block is seen with its parents), short of its last token (the manager's rule)."""
    bs, tokens, leaves, parent = variant.block_size, variant.tokens, variant.leaves, variant.tree.parent
    seen = bytearray(len(parent))
    for i in members:
        node, new = leaves[i], 0
        while node >= 0 and not seen[node]:
            seen[node] = 1
            new += 1
            node = parent[node]
        n = tokens[i]
        cached[i] = max(0, min(n // bs - new, (n - 1) // bs)) * bs  # a chain has n // bs blocks


def _drop_in_flight_hits(variant: Variant, order: Sequence[int], cached: array, timing: Timing) -> None:
    """A block is ready when the first request that computed it finished its prefill; a request arriving before
    that recomputes it and everything after it.

    Ready times never decrease along a chain, so the ready hits are a prefix of the replay's and only the blocks
    after it are visited. A negative logged prefill counts as zero."""
    bs, leaves, tokens, parent = variant.block_size, variant.leaves, variant.tokens, variant.tree.parent
    ready: dict[int, float] = {}  # every block of every request so far
    for i in order:
        t = timing.arrival[i]
        full, hit = tokens[i] // bs, cached[i] // bs
        node = leaves[i]
        for _ in range(full - hit):
            node = parent[node]
        while hit and ready[node] > t:  # node: the chain's block ``hit - 1``, cached so computed before
            hit -= 1
            node = parent[node]
        cached[i] = hit * bs
        logged = timing.prefill_s[i] if timing.prefill_s is not None else None
        done = t + max(0.0, logged if logged is not None else (tokens[i] - hit * bs) / PREFILL_TOKENS_PER_S)
        node = leaves[i]
        for _ in range(full - hit):
            was = ready.get(node)
            if was is not None and was <= done:  # so are all blocks before it
                break
            ready[node] = done
            node = parent[node]
