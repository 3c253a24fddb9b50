"""Eviction isolation between groups of requests (tenants): a reserved share of the pool for every group.

Salting keeps tenants from hitting each other's blocks, but with one LRU for all, the blocks one tenant loses
count another tenant's traffic ("prime and probe", docs/security.md). Here cached blocks never keep the room a
group below its share is still owed, so such a group is served from its own room and what it sends does not
change which blocks other groups lose.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence

from kvprefix.cache.free_queue import FreeBlockQueue, KVCacheBlock


class EvictionGroups:
    """A pool's free blocks by eviction group, in place of its one ``FreeBlockQueue`` (same queue protocol).

    Free blocks without a hash ("clean") wait in one queue, free cached blocks in their group's queue, each queue
    a ``queue_cls`` (its order is the order within a group; LRU by default). Every known group is reserved
    ``reserved = floor(num_blocks * reserve_fraction / known groups)`` blocks. The pool keeps

        cached blocks + owed <= num_blocks,   owed = sum over groups of max(0, reserved - cached blocks of group)

    by evicting what ``reclaim`` names after anything that can break it: a group joining, or a group over its
    share registering or releasing blocks. Blocks in use cannot be evicted, so it may lag until they are released.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock], reserve_fraction: float, queue_cls=FreeBlockQueue):
        if not 0.0 <= reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1], got {reserve_fraction}")
        self._queue_cls = queue_cls
        self.clean = queue_cls(blocks)
        self.num_blocks = self.num_free_blocks = self.clean.num_free_blocks
        self.reserve_fraction = reserve_fraction
        self.reserved = 0
        self._free: dict[Hashable, FreeBlockQueue] = {}  # group -> its free cached blocks
        self._cached: dict[Hashable, int] = {}  # group -> its blocks holding a hash, free or in use
        self._num_cached = 0
        self.owed = 0  # room still owed to groups below their share: sum of max(0, reserved - cached)

    def join(self, group: Hashable) -> None:
        """Makes ``group`` known: from now on it is reserved a share (every known group's share shrinks)."""
        if group in self._cached:
            return
        self._cached[group] = 0
        self._free[group] = self._queue_cls(())
        self.reserved = int(self.num_blocks * self.reserve_fraction) // len(self._cached)
        self.owed = sum(max(0, self.reserved - n) for n in self._cached.values())

    def num_cached(self, group: Hashable) -> int:
        return self._cached.get(group, 0)

    def _count(self, group: Hashable, delta: int) -> None:
        n, r = self._cached[group], self.reserved
        self.owed += max(0, r - n - delta) - max(0, r - n)
        self._cached[group] = n + delta
        self._num_cached += delta

    def add_cached(self, blocks: Sequence[KVCacheBlock], group: Hashable) -> None:
        """``blocks`` (in use) were just registered by a request of ``group``."""
        self.join(group)
        for block in blocks:
            block.group = group
        self._count(group, len(blocks))

    def drop_cached(self, block: KVCacheBlock) -> None:
        """``block`` gave up its hash outside ``take`` and ``reclaim`` (a released duplicate)."""
        self._count(block.group, -1)

    def take(self, group: Hashable) -> KVCacheBlock:
        """Removes the free block a new block of ``group`` is taken from (a known group; at least one block free).

        In order: a clean block, if enough stay clean for the room other groups are owed; the group's own next
        victim; any clean block; the next victim of the group with the most cached blocks. A cached block is
        uncounted here; dropping its hash is the pool's job.
        """
        clean, own = self.clean, self._free[group]
        owed_to_others = self.owed - max(0, self.reserved - self._cached[group])
        if clean.num_free_blocks > owed_to_others or (clean.num_free_blocks and not own.num_free_blocks):
            block = clean.popleft()
        else:
            block = (own if own.num_free_blocks else self._fullest(-1)).popleft()
            self._count(block.group, -1)
        self.num_free_blocks -= 1
        return block

    def reclaim(self, group: Hashable) -> KVCacheBlock | None:
        """A free cached block that must give up its hash because cached blocks keep room owed to a group below its
        share: ``group``'s next victim if ``group`` is over its share, else that of the group with the most cached
        blocks over its share. Moved to the clean queue and uncounted here; the pool drops its hash. None when
        nothing is owed, or every group over its share has all its cached blocks in use."""
        if self._num_cached + self.owed <= self.num_blocks:
            return None
        queue = self._free.get(group)
        if queue is None or not queue.num_free_blocks or self._cached[group] <= self.reserved:
            queue = self._fullest(self.reserved)
            if queue is None:
                return None
        block = queue.popleft()
        self._count(block.group, -1)
        self.clean.appendleft(block)
        return block

    def _fullest(self, more_than: int) -> FreeBlockQueue | None:
        """The free queue of the group with the most cached blocks (above ``more_than``) among those with one free:
        O(groups), reached only when a group cannot be served from clean room or its own blocks."""
        best = None
        most = more_than
        for group, queue in self._free.items():
            if queue.num_free_blocks and self._cached[group] > most:
                best, most = queue, self._cached[group]
        return best

    def clear(self) -> None:
        """After the pool forgot every hash (nothing in use): every free block is clean again."""
        for group, queue in self._free.items():
            for block in list(queue):
                queue.remove(block)
                self.clean.append(block)
            self._cached[group] = 0
        self._num_cached = 0
        self.owed = self.reserved * len(self._cached)

    # The queue protocol the pool uses (FreeBlockQueue's): a cached block is appended, a clean one appended left.
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
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.clean
        for queue in self._free.values():
            yield from queue
