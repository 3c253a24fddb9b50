"""The tiers below a replayed pool, for ``kvprefix simulate --disk-capacity`` and ``--shared-capacity``: the real
tiers' eviction (``tiers.LRUBytes``) without files or a Redis.

As in the engine (``engine.kv_tier``): every block a pool registers is written to each tier unless it holds it
already, least recently used objects go past the byte budget; after a prompt's pool hits, the following blocks the
disk holds are loaded (refreshing them), then those the shared tier holds, as disk and shared hits. Each replica
has its own disk; one shared tier serves every replica (written by every pool), as one Redis does a fleet.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvprefix.cache.events import BlockStored
from kvprefix.tiers.lru_bytes import LRUBytes


class SimTier:
    """``SimTier(capacity_bytes, block_bytes)``: at most ``capacity_bytes`` of ``block_bytes``-byte objects."""

    def __init__(self, capacity_bytes: int, block_bytes: int, name: str = "disk"):
        if block_bytes < 1 or capacity_bytes < block_bytes:
            raise ValueError(f"a {name} capacity of {capacity_bytes} bytes holds no {block_bytes}-byte block")
        self.capacity_bytes, self.block_bytes = capacity_bytes, block_bytes
        self.index = LRUBytes()
        self.evictions = 0

    def on_event(self, event) -> None:
        """A pool's events: a registered block is written (write-behind, never dropped here)."""
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                self.store(block_hash)

    def store(self, block_hash: Hashable) -> None:
        if block_hash in self.index:
            return  # held already: computed again, not read (the engine does not rewrite it either)
        for victim, _ in self.index.victims(self.index.room_needed(block_hash, self.block_bytes, self.capacity_bytes)):
            self.index.forget(victim)
            self.evictions += 1
        self.index.touch(block_hash, self.block_bytes)

    def load_following(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds; those are loaded (most recently used now)."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.index:
                break
            self.index.refresh(block_hash)
            n += 1
        return n
