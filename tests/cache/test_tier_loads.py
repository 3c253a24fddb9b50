"""Loading blocks from a lower tier into the pool (``claim_for_load`` / ``finish_load``): loaded blocks are
registered and hit like computed ones, the pool hits before them are never evicted to make room, blocks that
failed to load go back clean, and nothing leaks."""

from kvprefix.cache import BlockHasher, BlockStored, CacheRequest, KVCacheManager

BS = 4


def run(manager, request) -> int:
    hits, n = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - n, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    manager.free(request)
    return n


def test_loaded_blocks_hit_and_pool_hits_are_not_evicted_to_load() -> None:
    manager, hasher = KVCacheManager(6, BS), BlockHasher(BS)
    prefix = list(range(1, 9))  # 2 blocks, cached in the pool
    run(manager, CacheRequest("a", prefix + [99], hasher))
    run(manager, CacheRequest("b", [50 + i for i in range(13)], hasher))  # fills the rest: a's blocks are LRU
    req = CacheRequest("c", prefix + list(range(20, 33)), hasher)  # 5 full blocks after 2 cached, 21 tokens
    hits, _ = manager.get_computed_blocks(req)
    assert len(hits) == 2
    stored = []
    manager.events.subscribe(lambda e: stored.append(e) if isinstance(e, BlockStored) else None)
    blocks = manager.claim_for_load(req, hits, 3)
    assert len(blocks) == 3 and not {b.block_id for b in blocks} & {b.block_id for b in hits}
    manager.finish_load(req, hits, blocks, 2)  # the third failed to verify
    assert [e.block_hashes for e in stored] == [req.block_hashes[2:4]]
    hits, n = manager.get_computed_blocks(req)
    assert n == 4 * BS and hits[2:] == blocks[:2]
    assert blocks[2].block_hash is None and blocks[2].ref_cnt == 0
    assert run(manager, req) == 4 * BS
    assert manager.stats.hits == 4 * BS
    assert manager.pool.num_free_blocks == 6 and all(b.ref_cnt == 0 for b in manager.pool.blocks)


def test_a_claim_takes_no_more_than_the_free_blocks() -> None:
    manager, hasher = KVCacheManager(4, BS), BlockHasher(BS)
    holder = CacheRequest("h", list(range(100, 111)), hasher)
    manager.allocate_slots(holder, holder.num_tokens)  # 3 blocks held
    req = CacheRequest("r", list(range(1, 22)), hasher)
    blocks = manager.claim_for_load(req, [], 5)
    assert len(blocks) == 1
    manager.finish_load(req, [], blocks, 0)
    manager.free(holder)
    assert manager.pool.num_free_blocks == 4 and not manager.pool.cached_blocks
