"""The interface every tier below the pool implements, and the counters each keeps.

A tier is found by block hash alone: ``lookup`` says how many leading blocks of a run it holds (cheap, no
payload read), ``load`` reads and verifies one block (None for a miss, counted by reason: nothing that does not
verify is ever returned; ``load_into`` the same, straight into the caller's memory), ``store`` writes one (False
when dropped: full, failing, over budget), ``evict`` frees bytes in LRU order. Loads run on the engine's loader
thread and stores on each tier's writer thread, so every method is thread-safe. The engine talks to a chain of
``BlockStore``s (``engine.kv_tier``): the disk, then a shared store (``tiers.redis_store``); a host-RAM tier under
a CUDA pool would be another. A tier whose store can fail counts those calls in ``stats.failures`` and answers
them as misses or dropped writes: a tier never raises into the engine.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvprefix.tiers.objects import BlockObject, Expected


@dataclass
class TierStats:
    """Counters (never reset) of one tier; ``verify_failures``, ``dropped_writes`` and ``failures`` by reason. Writers of
    several threads take ``lock``."""

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
    usage_bytes: int = 0  # gauge: bytes this process counts in the tier
    num_objects: int = 0  # gauge
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("lookups", "lookup_blocks", "hit_blocks", "bytes_read",
                                             "bytes_written", "stores", "evictions", "usage_bytes", "num_objects")}
        out["verify_failures"] = sum(self.verify_failures.values())
        out["dropped_writes"] = sum(self.dropped_writes.values())
        out["failures"] = sum(self.failures.values())
        return out


class BlockStore(Protocol):
    name: str  # the tier's name in counters and cache_detail: "disk"
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

    def store(self, obj: BlockObject) -> bool:
        """Writes one block; False when the write was dropped (counted by reason)."""

    def evict(self, num_bytes: int) -> int:
        """Deletes least recently used objects until ``num_bytes`` are freed; returns the bytes freed."""
