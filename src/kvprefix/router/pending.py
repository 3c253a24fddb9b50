"""Blocks that requests already routed to a replica are about to compute: a multiset of hashes.

A view counts them as cached, as a router that remembers where it sent prefixes sees them; without this a burst
of requests with one new prefix looks uncached everywhere until the first of them finishes prefill. Used by the
planner's view and the HTTP router's alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class PendingBlocks:
    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._count

    def add(self, block_hashes: Sequence[Hashable]) -> None:
        count = self._count
        for h in block_hashes:
            count[h] = count.get(h, 0) + 1

    def drop(self, block_hashes: Sequence[Hashable]) -> None:
        count = self._count
        for h in block_hashes:
            if count[h] == 1:
                del count[h]
            else:
                count[h] -= 1
