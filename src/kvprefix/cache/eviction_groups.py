"""Eviction isolation between groups of requests (tenants): a reserved share of the pool for every group.

With one LRU for all, the blocks one tenant loses count another's traffic ("prime and probe", docs/security.md).
Here clean free blocks always cover the room owed to groups below their share, so what one group does never changes
the pool's choices for the others.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

from kvprefix.cache.free_queue import FreeBlockQueue, KVCacheBlock


class EvictionGroups:
    """A pool's free blocks by eviction group, in place of its one ``FreeBlockQueue`` (same queue protocol).

    Clean (hashless) free blocks wait in one queue, free cached blocks in their group's ``queue_cls`` (LRU by
    default). A group's footprint: the non-clean blocks it took (held, or cached and free). Each known group is
    reserved ``floor(num_blocks * reserve_fraction / known groups)`` blocks, and the pool keeps

        clean free blocks >= owed = sum over known groups of max(0, reserved - footprint)

    ``take`` keeps it unless a group at or over its share has nothing of its own to recycle (it borrows rather than
    stall a running request); ``reclaim`` restores it.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock], reserve_fraction: float, queue_cls=FreeBlockQueue):
        if not 0.0 <= reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1], got {reserve_fraction}")
        self._queue_cls = queue_cls
        self.clean = queue_cls(blocks)
        self.num_blocks = self.num_free_blocks = self.clean.num_free_blocks
        self.reserve_fraction = reserve_fraction
        self.reserved = 0
        self.owed = 0
        self._free: dict[Hashable, FreeBlockQueue] = {}  # group -> its free cached blocks
        self._footprint: dict[Hashable, int] = {}

    def join(self, group: Hashable) -> None:
        """Makes ``group`` known: from now on it is reserved a share (every known group's share shrinks)."""
        if group in self._footprint:
            return
        self._footprint[group] = 0
        self._free[group] = self._queue_cls(())
        self.reserved = int(self.num_blocks * self.reserve_fraction) // len(self._footprint)
        self.owed = sum(max(0, self.reserved - n) for n in self._footprint.values())

    def footprint(self, group: Hashable) -> int:
        return self._footprint.get(group, 0)

    def _count(self, group: Hashable, delta: int) -> None:
        n, r = self._footprint[group], self.reserved
        self.owed += max(0, r - n - delta) - max(0, r - n)
        self._footprint[group] = n + delta

    def take(self, group: Hashable) -> KVCacheBlock:
        """Removes the free block a request of ``group`` (known) gets next; at least one block must be free.

        Below its share: a clean block. At or over it: a clean block while more than ``owed`` are clean, else its
        own next victim, else it borrows (any clean block, else the largest group's victim). The pool drops hashes.
        """
        clean, own = self.clean, self._free[group]
        n = clean.num_free_blocks
        if n and (self._footprint[group] < self.reserved or n > self.owed or not own.num_free_blocks):
            block = clean.popleft()
        else:
            block = (own if own.num_free_blocks else self._fullest(-1)).popleft()
            self._count(block.group, -1)
        block.group = group
        self._count(group, 1)
        self.num_free_blocks -= 1
        return block

    def reclaim(self, group: Hashable) -> KVCacheBlock | None:
        """While fewer blocks are clean than owed: a free cached block to evict in place (``group``'s if it is over
        its share, else the furthest-over group's), moved to the clean queue; else None. The pool drops its hash."""
        if self.clean.num_free_blocks >= self.owed:
            return None
        queue = self._free.get(group)
        if queue is None or not queue.num_free_blocks or self._footprint[group] <= self.reserved:
            queue = self._fullest(self.reserved)
            if queue is None:
                return None
        block = queue.popleft()
        self._count(block.group, -1)
        self.clean.appendleft(block)
        return block

    def _fullest(self, more_than: int) -> FreeBlockQueue | None:
        """The free queue of the largest-footprint group (above ``more_than``) with a free cached block; O(groups)."""
        best, most = None, more_than
        for group, queue in self._free.items():
            if queue.num_free_blocks and self._footprint[group] > most:
                best, most = queue, self._footprint[group]
        return best

    def clear(self) -> None:
        """After the pool forgot every hash (nothing in use): every block is clean again."""
        for group, queue in self._free.items():
            for block in list(queue):
                queue.remove(block)
                self.clean.append(block)
            self._footprint[group] = 0
        self.owed = self.reserved * len(self._footprint)

    # The queue protocol the pool uses (FreeBlockQueue's): a released cached block is appended, a released block
    # without a hash appended left; ``remove`` takes back a free cached block (a hit).
    def _queue_of(self, block: KVCacheBlock) -> FreeBlockQueue:
        return self.clean if block.block_hash is None else self._free[block.group]

    def remove(self, block: KVCacheBlock) -> None:
        self._queue_of(block).remove(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._free[block.group].append(block)
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        self.clean.appendleft(block)
        self._count(block.group, -1)
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.clean
        for queue in self._free.values():
            yield from queue
