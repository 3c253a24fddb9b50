"""A small KV cache manager for the cache tests, and what they do with it: admit and run a request, read the
pool's whole state."""

from kvprefix.cache import BlockHasher, KVCacheManager

BS = 4


def make(manager_blocks=16, caching=True):
    return KVCacheManager(manager_blocks, BS, enable_prefix_caching=caching), BlockHasher(BS)


def admit_and_run(manager, request):
    """Admits a request, computes its whole prompt and registers its full blocks (one scheduler step)."""
    hits, n = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - n, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return n


def state(manager):
    pool = manager.pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        dict(pool.cached_blocks),
        {k: list(v) for k, v in manager.req_to_blocks.items()},
        manager.stats.snapshot(),
    )

