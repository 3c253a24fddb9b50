"""The interface every tier below the pool implements, and the counters each keeps.

A tier is found by block hash alone: ``lookup`` says how many leading blocks of a run it holds (cheap, no
payload read), ``load`` reads and verifies one block (None for a miss, counted by reason: nothing that does not
verify is ever returned; ``load_into`` the same, straight into the caller's memory), ``store`` writes one (False
when dropped: full, failing, over budget), ``evict`` frees bytes in LRU order.

Retention (docs/tiers.md#retention) adds three small things: ``store(obj, retain_until, tenant)`` and ``retain``
pass a block over in eviction until a time (epoch seconds, kept across restarts by the tier itself), and
``retained_bytes(tenant, besides)`` is what a tenant keeps retained now, for its budget. A tier that cannot keep room for a
write because the rest is retained drops the write (``dropped_writes{retained}``). The engine talks to a
``BlockStore``; the disk is the first implementation, a shared store or a host-RAM tier under a CUDA pool are the
next.
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
    """Counters (never reset) of one tier; ``verify_failures`` and ``dropped_writes`` by reason. Writers of
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
    usage_bytes: int = 0  # gauge: bytes this process counts in the tier
    num_objects: int = 0  # gauge
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("lookups", "lookup_blocks", "hit_blocks", "bytes_read",
                                             "bytes_written", "stores", "evictions", "usage_bytes", "num_objects")}
        out["verify_failures"] = sum(self.verify_failures.values())
        out["dropped_writes"] = sum(self.dropped_writes.values())
        return out


class BlockStore(Protocol):
    name: str  # the tier's name in counters and cache_detail: "disk"
    max_bytes: int  # its byte budget
    stats: TierStats

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds (up to the first it does not)."""

    def contains(self, block_hash: bytes) -> bool: ...

    def load(self, expected: Expected) -> BlockObject | None:
        """The verified block ``expected`` names, or None (absent or not verifying: counted, never served)."""

    def load_into(self, expected: Expected, spans: Sequence[memoryview]) -> bool:
        """Reads the block's payload into ``spans`` (the caller's memory, in payload order); True only when it
        verifies (on False the spans hold garbage and must not be used)."""

    def store(self, obj: BlockObject, retain_until: float | None = None, tenant: str = "") -> bool:
        """Writes one block (with ``retain_until``: retained, see ``retain``; a block already held is only
        retained); False when the write was dropped (counted by reason)."""

    def retain(self, block_hash: bytes, until: float, tenant: str) -> bool:
        """Passes the held block over in eviction until ``until`` (only ever extended), counted against
        ``tenant``; False when the tier does not hold it."""

    def retained_bytes(self, tenant: str, besides: Sequence[bytes] = ()) -> int:
        """Bytes of the blocks ``tenant`` keeps retained now, not counting those of ``besides`` (a request's own,
        retained again)."""

    def evict(self, num_bytes: int) -> int:
        """Deletes least recently used objects until ``num_bytes`` are freed; returns the bytes freed."""
