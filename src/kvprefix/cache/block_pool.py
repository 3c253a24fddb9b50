"""A fixed pool of KV blocks: ref counts, an LRU queue of free blocks, and the hash -> cached block map."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from functools import partial

from kvprefix.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher
from kvprefix.cache.eviction_groups import EvictionGroups
from kvprefix.cache.free_queue import FreeBlockQueue, KVCacheBlock
from kvprefix.cache.request import CacheRequest
from kvprefix.cache.stats import PrefixCacheStats


class BlockPool:
    """Owns every block. Free blocks that still hold a cached hash are eviction candidates in LRU order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        free_queue_cls: type[FreeBlockQueue] = FreeBlockQueue,
        reserve_fraction: float = 0.0,
    ):
        """``free_queue_cls`` is the eviction policy: its ``popleft`` picks the victim (default LRU).

        ``reserve_fraction`` > 0 isolates eviction groups (``EvictionGroups``), ``free_queue_cls`` then ordering
        blocks within each group; 0 is one queue for all (groups ignored)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.groups = EvictionGroups(self.blocks, reserve_fraction, free_queue_cls) if reserve_fraction else None
        self.free_queue = self.groups if self.groups is not None else free_queue_cls(self.blocks)
        # hash -> the block hits are served from. Two requests that compute the same content in one step make two
        # blocks of one hash: while in use, the later ones wait in _duplicates and take over should the served one
        # be evicted, so the hash stays cached while any copy lives; released, a copy gives up its hash.
        self.cached_blocks: dict[Hashable, KVCacheBlock] = {}
        self._duplicates: dict[Hashable, list[KVCacheBlock]] = {}
        self.events = EventPublisher()
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Takes a reference on cache-hit blocks; a free one leaves the eviction queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int, group: Hashable = None) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` from the front of the free queue (with eviction groups, where ``EvictionGroups.take``
        says for a request of ``group``), evicting their cached hashes."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.free_queue.num_free_blocks} free")
        if self.groups is None:
            popleft = self.free_queue.popleft
        else:
            self.groups.join(group)
            self._reclaim(group)  # a group's first request: its room is made clean before it takes any
            popleft = partial(self.groups.take, group)
        out = []
        evicted = []
        num_evicted = 0
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                num_evicted += 1
                gone = self._evict(block)
                if gone is not None:
                    evicted.append(gone)
            block.ref_cnt = 1
            out.append(block)
        self.stats.evictions += num_evicted
        if evicted and self.events.active:
            self.events.publish(BlockRemoved(evicted))
        return out

    def _evict(self, block: KVCacheBlock) -> Hashable | None:
        """Drops the block's hash; returns the hash if no other copy serves it any more."""
        block_hash = block.block_hash
        block.block_hash = None
        copies = self._duplicates.get(block_hash)
        if copies is None:
            del self.cached_blocks[block_hash]
            return block_hash
        if self.cached_blocks[block_hash] is block:
            self.cached_blocks[block_hash] = copies.pop()
        else:
            copies.remove(block)
        if not copies:
            del self._duplicates[block_hash]
        return None

    def cache_full_blocks(
        self, request: CacheRequest, blocks: Sequence[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under the request's block hashes (a hash already
        served keeps the new block as a copy; see ``cached_blocks``)."""
        cached = self.cached_blocks
        hashes = request.block_hashes
        hasher = request.hasher
        root, namespace = (hasher.root, hasher.namespace_id) if hasher is not None else (None, "")
        stored: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:  # a hit block, registered already
                continue
            block_hash = hashes[i]
            block.block_hash = block_hash
            block.parent_hash = hashes[i - 1] if i else root
            block.namespace = namespace
            if block_hash in cached:
                self._duplicates.setdefault(block_hash, []).append(block)
            else:
                cached[block_hash] = block
                stored.append(i)
        if stored and self.events.active:
            self._publish_stored(request, stored, root, namespace)

    def _publish_stored(self, request: CacheRequest, indices: list[int], root, namespace: str) -> None:
        """One BlockStored per run of consecutive block indices, so each event has a single parent."""
        bs = self.block_size
        extras = request.extras if request.extras is not None and not request.extras.is_empty() else None
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[run_start], indices[k - 1]
            self.events.publish(
                BlockStored(
                    block_hashes=request.block_hashes[first : last + 1],
                    parent_block_hash=request.block_hashes[first - 1] if first else root,
                    token_ids=request.token_ids[first * bs : (last + 1) * bs] if request.token_ids else None,
                    block_size=bs,
                    extra_keys=[extras.keys_for_block(i, bs) for i in range(first, last + 1)] if extras else None,
                    namespace=namespace,
                )
            )
            run_start = k

    def free(self, blocks: Iterable[KVCacheBlock], group: Hashable = None) -> None:
        """Drops one reference from each block, in order; unreferenced blocks become free: cached ones at the back of
        the queue, hashless ones at the front (reused first). ``group`` is the releasing request's."""
        queue = self.free_queue
        duplicates = self._duplicates
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if duplicates and block.block_hash in duplicates and self._drop_copy(block):
                    queue.appendleft(block)
                elif block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
        if self.groups is not None:
            self._reclaim(group)  # borrowed room comes back: released blocks over a share may give it up

    def _reclaim(self, group: Hashable) -> None:
        """Evicts free cached blocks (they stay free, now clean) until no group's owed room is held by them."""
        groups = self.groups
        evicted = []
        while (block := groups.reclaim(group)) is not None:
            self.stats.evictions += 1
            gone = self._evict(block)
            if gone is not None:
                evicted.append(gone)
        if evicted and self.events.active:
            self.events.publish(BlockRemoved(evicted))

    def _drop_copy(self, block: KVCacheBlock) -> bool:
        """A released duplicate gives up its hash (True) while the served block exists: copies matter only in use."""
        block_hash = block.block_hash
        if self.cached_blocks[block_hash] is block:
            return False
        copies = self._duplicates[block_hash]
        copies.remove(block)
        if not copies:
            del self._duplicates[block_hash]
        block.block_hash = None
        return True

    def snapshot(self) -> list[tuple[Hashable, Hashable | None, str]]:
        """(hash, parent hash, namespace id) of every cached hash, in the order they were registered."""
        return [(h, b.parent_hash, b.namespace) for h, b in self.cached_blocks.items()]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refuses (returns False, changes nothing) while any block is referenced."""
        if self.num_used_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        for copies in self._duplicates.values():
            for block in copies:
                block.block_hash = None
        self.cached_blocks.clear()
        self._duplicates.clear()
        if self.groups is not None:
            self.groups.clear()
        self.stats.resets += 1
        if self.events.active:
            self.events.publish(AllBlocksCleared())
        return True
