"""A KV block and the free list the pool keeps its free blocks in (linked through the blocks, O(1) everywhere)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class KVCacheBlock:
    """One block of KV slots. ``block_hash`` is set while the block is registered in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "namespace", "group", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        # While registered: its chain's previous hash and namespace id, for cache snapshots.
        self.parent_hash: Hashable | None = None
        self.namespace = ""
        self.group: Hashable = None  # with eviction groups: the group whose request took it last
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash!r})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks. Front = next taken (least recently released);
    O(1) removal from the middle is how a hit takes a free block back."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels keep every link operation branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free
