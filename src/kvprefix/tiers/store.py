"""The interface every tier below the pool implements, and the counters each keeps.

A tier is found by block hash alone: ``lookup`` says how many leading blocks of a run it holds (cheap, no
payload read), ``load`` reads and verifies one block (None for a miss, counted by reason: nothing that does not
verify is ever returned; ``load_into`` the same, straight into the caller's memory), ``store`` writes one (False
when dropped: full, failing, over budget), ``evict`` frees bytes in LRU order. Loads run on the engine's loader
thread and stores on each tier's writer thread, so every method is thread-safe. The engine talks to a chain of
``BlockStore``s (``engine.kv_tier``): the disk, then a shared store (``tiers.redis_store``); a host-RAM tier under
a CUDA pool would be another. A tier whose store can fail counts those calls in ``stats.failures`` and answers
them as misses or dropped writes: a tier never raises into the engine.

Retention (docs/tiers.md#retention) adds three small things: ``store(obj, retain_until, tenant)`` and ``retain``
pass a block over in eviction until a time (epoch seconds, kept across restarts by the tier itself), and
``retained_bytes(tenant, besides)`` is what a tenant keeps retained now, for its budget. A tier that cannot keep
room for a write because the rest is retained drops the write (``dropped_writes{retained}``).

Claims (docs/tiers.md#one-computation-per-fleet): ``claim`` marks blocks this replica is about to compute in a store
other replicas read, and says how many of them another replica is computing already; the engine waits for those.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvprefix.tiers.objects import BlockObject, Expected
from kvprefix.tiers.presence import TierPresence

# The counters kept by a label, and its name: what Prometheus families and flat metrics carry them as.
BY_LABEL = {"verify_failures": "reason", "dropped_writes": "reason", "failures": "reason", "claim_waits": "outcome"}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds


@dataclass
class Latency:
    """A histogram of durations in seconds (``LATENCY_BUCKETS``; not cumulative: each count once, then +Inf)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.counts[i] += 1
        self.total += seconds

    def flat(self, name: str) -> dict[str, float]:
        """``name_le_B`` (cumulative), ``name_count`` and ``name_sum``, as the engine's flat metrics carry them."""
        out, running = {}, 0
        for b, n in zip(LATENCY_BUCKETS, self.counts, strict=False):
            running += n
            out[f"{name}_le_{b}"] = running
        return out | {f"{name}_count": sum(self.counts), f"{name}_sum": self.total}


@dataclass
class TierStats:
    """Counters (never reset) of one tier; ``verify_failures``, ``dropped_writes`` and ``failures`` by reason,
    ``claim_waits`` by outcome. Writers of several threads take ``lock``."""

    lookups: int = 0  # lookup calls
    lookup_blocks: int = 0  # blocks asked about
    hit_blocks: int = 0  # blocks loaded and verified
    bytes_read: int = 0
    bytes_written: int = 0
    stores: int = 0  # objects written
    evictions: int = 0  # objects deleted for room
    verify_failures: Counter = field(default_factory=Counter)
    dropped_writes: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # calls the store itself failed (down, timed out): misses
    claims: int = 0  # blocks this replica claimed to compute them (a shared store: ``RedisStore.claim``)
    claim_waits: Counter = field(default_factory=Counter)  # requests that waited on another's claims, by outcome
    usage_bytes: int = 0  # gauge: bytes this process counts in the tier
    num_objects: int = 0  # gauge
    load_seconds: Latency = field(default_factory=Latency)  # one request's run of blocks loaded (engine.kv_tier)
    store_seconds: Latency = field(default_factory=Latency)  # one block written (tiers.write_behind)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("lookups", "lookup_blocks", "hit_blocks", "bytes_read", "bytes_written",
                                             "stores", "evictions", "claims", "usage_bytes", "num_objects")}
        for key in BY_LABEL:
            out[key] = sum(getattr(self, key).values())
        return out


class BlockStore(Protocol):
    name: str  # the tier's name in counters and cache_detail: "disk"
    medium: str  # its name in KV events (``cache.media``): "Disk"
    store_id: str  # names a store every replica reads ("" for the disk): replicas announcing it share its blocks
    sees_evictions: bool  # whether ``watch`` reports every block the tier deletes on its own (the disk; not Redis)
    max_bytes: int  # its byte budget
    # True when ``lookup`` answers without a round trip (the engine then asks on its step, else on its loader
    # thread). ``contains`` is asked on the writer thread, before a write.
    local_lookup: bool
    stats: TierStats

    def lookup(self, block_hashes: Sequence[bytes], namespace: str = "") -> int:
        """How many leading blocks of ``block_hashes`` the tier holds (up to the first it does not). ``namespace``
        is the namespace id they were computed under: a shared store keys by it, the disk by the hash alone."""

    def contains(self, block_hash: bytes, namespace: str = "") -> bool: ...

    def load(self, expected: Expected) -> BlockObject | None:
        """The verified block ``expected`` names, or None (absent or not verifying: counted, never served)."""

    def load_into(self, expected: Expected, spans: Sequence[memoryview]) -> bool:
        """Reads the block's payload into ``spans`` (the caller's memory, in payload order); True only when it
        verifies (on False the spans hold garbage and must not be used)."""

    def claim(self, block_hashes: Sequence[bytes], namespace: str, seconds: float) -> int:
        """Claims, for ``seconds``, the blocks of a run the tiers do not hold, which this replica is about to
        compute; returns how many leading blocks of the run another replica claimed first (it is computing them:
        wait for them). A store others do not read claims nothing and returns 0; the claim of a block ends when the
        block is stored, or after ``seconds``."""

    def store(self, obj: BlockObject, retain_until: float | None = None, tenant: str = "") -> bool:
        """Writes one block (with ``retain_until``: retained, see ``retain``; a block already held is only
        retained); False when the write was dropped (counted by reason)."""

    def retain(self, block_hash: bytes, until: float, tenant: str) -> bool:
        """Passes the held block over in eviction until ``until`` (only ever extended), counted against
        ``tenant``; False when the tier does not hold it."""

    def retained_bytes(self, tenant: str, besides: Sequence[bytes] = ()) -> int:
        """Bytes of the blocks ``tenant`` keeps retained now, not counting those of ``besides`` (a request's own,
        retained again)."""

    def watch(self, presence: TierPresence) -> None:
        """Tells ``presence`` of the blocks the tier holds now and of those it deletes on its own from now on (the
        engine tells it of what it writes and misses)."""

    def evict(self, num_bytes: int) -> int:
        """Deletes least recently used objects until ``num_bytes`` are freed; returns the bytes freed."""
