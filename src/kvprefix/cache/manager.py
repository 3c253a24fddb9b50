"""KV cache manager: what a scheduler calls to look up, allocate, register and free a request's blocks."""

from __future__ import annotations

from collections.abc import Sequence

from kvprefix.cache.block_pool import BlockPool
from kvprefix.cache.free_queue import FreeBlockQueue, KVCacheBlock
from kvprefix.cache.request import CacheRequest
from kvprefix.cache.stats import PrefixCacheStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to block tables over one ``BlockPool``.

    Call order per request: ``get_computed_blocks`` (no side effects) -> ``allocate_slots`` (claims hit blocks and
    new blocks atomically, or returns None and changes nothing) -> compute -> ``cache_blocks`` after the step
    (registers blocks that became full) -> ... -> ``free`` (tail first).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        free_queue_cls: type[FreeBlockQueue] = FreeBlockQueue,
        reserve_fraction: float = 0.0,
    ):
        """``reserve_fraction`` > 0 isolates eviction between the requests' ``eviction_group``s (``BlockPool``)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, free_queue_cls, reserve_fraction)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered (or were found cached).
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    @property
    def events(self):
        return self.pool.events

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached blocks from the start of the request, and the tokens they cover.

        Stops at the first miss and leaves at least the last token to compute (its logits are needed).
        Changes nothing: the blocks are claimed only by ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._check_block_size(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.pool.cached_blocks.get
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens (on admission, pass the hits from ``get_computed_blocks``).
        Returns the new blocks, or None, with nothing changed, when the pool cannot satisfy it (caller may preempt).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        admitting = req_blocks is None
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_held = 0 if admitting else len(req_blocks)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # Hit blocks that sit in the free queue are about to leave it: they cannot also be handed out as new.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        if admitting:
            req_blocks = self.req_to_blocks[rid] = []
            self._num_cached_blocks[rid] = 0
            self._count_admission(request, num_hit_tokens)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self._num_cached_blocks[rid] = len(req_blocks)
            request.num_computed_tokens = num_computed
        new_blocks = self.pool.get_new_blocks(num_new_blocks, request.eviction_group) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        self.pool.events.flush()  # only now: the request's blocks are recorded, whatever a subscriber does
        return new_blocks

    def _count_admission(self, request: CacheRequest, num_hit_tokens: int) -> None:
        stats = self.pool.stats
        if request.num_cached_tokens < 0:  # first admission
            request.num_cached_tokens = num_hit_tokens
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens
        else:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens

    def _check_block_size(self, request: CacheRequest) -> None:
        """Hashes of another block size name other token spans: a hit would serve the wrong KV."""
        if request.block_size is not None and request.block_size != self.block_size:
            raise ValueError(
                f"request {request.request_id!r} is hashed in {request.block_size}-token blocks, but this cache's "
                f"blocks hold {self.block_size} tokens"
            )

    def cache_blocks(self, request: CacheRequest, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full within its first ``num_computed_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        req_blocks = self.req_to_blocks[rid]
        start = self._num_cached_blocks[rid]
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(req_blocks))
        if end > start:
            self._check_block_size(request)
            self.pool.cache_full_blocks(request, req_blocks, start, end)
            self._num_cached_blocks[rid] = end
            self.pool.events.flush()

    def fork(self, parent: CacheRequest, child: CacheRequest) -> list[tuple[int, int]] | None:
        """Gives ``child`` (a copy of ``parent``'s tokens and progress: a new beam) the parent's blocks: each full block
        shared (one more reference), and the partial last block, which the child writes next, as a fresh block
        (copy-on-write). Returns the (source, destination) block ids whose KV the caller must copy before the next
        step (none when the parent's blocks are all full), or None, with nothing changed, when no block is free."""
        blocks = self.req_to_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        partial = blocks[num_full:]
        if len(partial) > 1 or len(blocks) != cdiv(parent.num_computed_tokens, self.block_size):
            raise ValueError(f"request {parent.request_id!r} holds {len(blocks)} blocks for "
                             f"{parent.num_computed_tokens} computed tokens: only a beam at rest can be forked")
        if partial and self.pool.num_free_blocks < 1:
            return None
        shared = blocks[:num_full]
        self.pool.touch(shared)
        copies = []
        if partial:
            (fresh,) = self.pool.get_new_blocks(1, child.eviction_group)
            copies.append((partial[0].block_id, fresh.block_id))
            shared = [*shared, fresh]
        self.req_to_blocks[child.request_id] = shared
        self._num_cached_blocks[child.request_id] = min(self._num_cached_blocks[parent.request_id], num_full)
        self.pool.events.flush()
        return copies

    def claim_for_load(self, request: CacheRequest, hits: Sequence[KVCacheBlock], num_blocks: int
                       ) -> list[KVCacheBlock]:
        """Up to ``num_blocks`` fresh blocks to load the request's blocks after ``hits`` into from a lower tier
        (fewer when the pool has fewer free). The hits are held meanwhile, so taking blocks cannot evict them;
        ``finish_load`` registers what was loaded and releases everything."""
        self.pool.touch(hits)
        num = max(0, min(num_blocks, self.pool.num_free_blocks))
        blocks = self.pool.get_new_blocks(num, request.eviction_group) if num else []
        self.pool.events.flush()
        return blocks

    def finish_load(self, request: CacheRequest, hits: Sequence[KVCacheBlock], blocks: Sequence[KVCacheBlock],
                    num_loaded: int) -> None:
        """Registers ``blocks[:num_loaded]`` (their KV is written) under the request's block hashes that follow
        ``hits``, then releases hits and blocks: the loaded ones stay cached (the next lookup hits them), the rest
        go back clean."""
        if num_loaded:
            start = len(hits)
            placed = [*hits, *blocks[:num_loaded]]
            self.pool.cache_full_blocks(request, placed, start, start + num_loaded)
        self.pool.free(reversed([*hits, *blocks]), request.eviction_group)
        self.pool.events.flush()

    def free(self, request: CacheRequest) -> None:
        """Releases the request's blocks tail first, so the head of a shared prefix stays cached longest."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.free(reversed(blocks), request.eviction_group)
            if self.pool.groups is not None:
                self.pool.events.flush()  # releasing can evict: a group over its share gives back borrowed room

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        self.pool.events.flush()
        return ok
