"""Behaviour of the block pool and the KV cache manager, one rule per test."""

import pytest
from support.managers import BS, admit_and_run, make, state

from kvprefix.cache import (
    BlockHasher,
    BlockRemoved,
    BlockStored,
    CacheRequest,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
)


def test_free_queue_is_o1_linked_lru():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft().block_id == 0
    q.remove(blocks[4])
    q.appendleft(blocks[4])
    assert [b.block_id for b in q] == [4, 1, 3, 2]
    assert q.num_free_blocks == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_second_request_hits_shared_full_blocks():
    manager, hasher = make()
    prefix = list(range(10))  # 2 full blocks + 2 tokens
    a = CacheRequest("a", prefix + [50, 51], hasher)
    assert admit_and_run(manager, a) == 0
    manager.free(a)
    b = CacheRequest("b", prefix + [60, 61, 62], hasher)
    hits, n = manager.get_computed_blocks(b)
    assert n == 8 and [blk.block_hash for blk in hits] == b.block_hashes[:2]
    assert admit_and_run(manager, b) == 8
    assert b.num_cached_tokens == 8


def test_partial_block_never_hits():
    manager, hasher = make()
    a = CacheRequest("a", [1, 2, 3], hasher)
    admit_and_run(manager, a)
    manager.free(a)
    b = CacheRequest("b", [1, 2, 3, 9, 9], hasher)
    assert manager.get_computed_blocks(b) == ([], 0)


def test_block_aligned_prompt_still_computes_its_last_token():
    manager, hasher = make()
    tokens = list(range(8))
    a = CacheRequest("a", tokens, hasher)
    admit_and_run(manager, a)
    manager.free(a)
    b = CacheRequest("b", tokens, hasher)
    _, n = manager.get_computed_blocks(b)
    assert n == 4  # the second block holds the last token, whose logits are needed
    assert admit_and_run(manager, b) == 4


def test_different_salt_never_shares_same_salt_does():
    manager, hasher = make()
    tokens = list(range(12))
    a = CacheRequest("a", tokens, hasher.with_salt("tenant-a"))
    admit_and_run(manager, a)
    manager.free(a)
    other = CacheRequest("b", tokens, hasher.with_salt("tenant-b"))
    same = CacheRequest("c", tokens, hasher.with_salt("tenant-a"))
    unsalted = CacheRequest("d", tokens, hasher)
    assert manager.get_computed_blocks(other)[1] == 0
    assert manager.get_computed_blocks(unsalted)[1] == 0
    assert manager.get_computed_blocks(same)[1] == 8


def test_lookup_has_no_side_effects():
    manager, hasher = make()
    a = CacheRequest("a", list(range(12)), hasher)
    admit_and_run(manager, a)
    manager.free(a)
    before = state(manager)
    manager.get_computed_blocks(CacheRequest("b", list(range(12)), hasher))
    assert state(manager) == before


def test_failed_allocation_changes_nothing():
    manager, hasher = make(manager_blocks=4)
    a = CacheRequest("a", list(range(8)), hasher)
    admit_and_run(manager, a)
    manager.free(a)
    big = CacheRequest("big", list(range(8)) + list(range(100, 120)), hasher)  # 7 blocks, 2 hit: needs 5 more
    before = state(manager)
    hits, n = manager.get_computed_blocks(big)
    assert n == 8
    assert manager.allocate_slots(big, big.num_tokens - n, hits) is None
    assert state(manager) == before
    assert big.num_computed_tokens == 0 and big.num_cached_tokens == -1


def test_allocation_never_evicts_the_hit_blocks_it_reuses():
    manager, hasher = make(manager_blocks=4)
    a = CacheRequest("a", list(range(9)), hasher)  # 3 blocks, 2 registered
    admit_and_run(manager, a)
    manager.free(a)
    # 2 hit blocks (free, cached) + 2 new blocks: exactly the pool. The two new ones must not be the hit ones.
    b = CacheRequest("b", list(range(8)) + [70] * 8, hasher)
    hits, n = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, b.num_tokens - n, hits)
    assert new is not None and len(new) == 2
    ids = manager.get_block_ids("b")
    assert len(set(ids)) == 4
    assert [blk.block_hash for blk in hits] == b.block_hashes[:2]
    # Asking for one block more than is free without the hits fails.
    c = CacheRequest("c", [5] * 4, hasher)
    assert manager.allocate_slots(c, 4) is None


def test_lru_eviction_takes_least_recently_released_first():
    manager, hasher = make(manager_blocks=4)
    reqs = [CacheRequest(f"r{i}", [i] * BS + [99], hasher) for i in range(3)]  # 1 full block + 1 partial each
    for r in reqs:
        admit_and_run(manager, r)
        manager.free(r)
    hashes = [r.block_hashes[0] for r in reqs]
    evicted = []
    manager.events.subscribe(lambda e: evicted.extend(e.block_hashes) if isinstance(e, BlockRemoved) else None)
    # The free partial block (no hash, worthless) goes first, then cached blocks in release order.
    assert manager.allocate_slots(CacheRequest("f", [7] * 8, hasher), 8) is not None
    assert evicted == hashes[:1]
    assert manager.allocate_slots(CacheRequest("g", [8] * 4, hasher), 4) is not None
    assert evicted == hashes[:2]
    assert manager.pool.get_cached_block(hashes[2]) is not None
    assert manager.stats.evictions == 2


def test_hit_moves_block_out_of_eviction_order():
    manager, hasher = make(manager_blocks=3)
    a = CacheRequest("a", [1] * BS + [2], hasher)
    b = CacheRequest("b", [3] * BS + [4], hasher)
    for r in (a, b):
        admit_and_run(manager, r)
        manager.free(r)
    # Reuse a's block: it is referenced now, so allocating 2 fresh blocks must evict b's, not a's.
    a2 = CacheRequest("a2", [1] * BS + [5], hasher)
    assert admit_and_run(manager, a2) == BS
    other = CacheRequest("o", [9] * 8, hasher)
    assert manager.allocate_slots(other, 1) is not None
    assert manager.pool.get_cached_block(a.block_hashes[0]) is not None


def test_free_releases_tail_first():
    manager, hasher = make(manager_blocks=8)
    r = CacheRequest("r", list(range(16)), hasher)  # 4 full blocks
    admit_and_run(manager, r)
    ids = manager.get_block_ids("r")
    manager.free(r)
    order = [b.block_id for b in manager.pool.free_queue]
    assert order[-4:] == ids[::-1]  # head of the prefix is released last, so it is evicted last


def test_evicted_and_reused_block_carries_no_stale_hash():
    manager, hasher = make(manager_blocks=2)
    a = CacheRequest("a", [1] * 8, hasher)
    admit_and_run(manager, a)
    manager.free(a)
    b = CacheRequest("b", [2] * 8, hasher)
    hits, n = manager.get_computed_blocks(b)
    assert n == 0
    manager.allocate_slots(b, 8)
    assert all(blk.block_hash is None for blk in manager.req_to_blocks["b"])
    assert manager.pool.get_cached_block(a.block_hashes[0]) is None
    assert manager.stats.evictions == 2
    # b's blocks are not cached until computed; then they hold b's hashes only.
    b.num_computed_tokens = 8
    manager.cache_blocks(b, 8)
    assert [blk.block_hash for blk in manager.req_to_blocks["b"]] == b.block_hashes


def test_same_content_computed_twice_stays_cached_while_any_copy_lives():
    """Two requests admitted in one step compute the same blocks: evicting one copy must not drop the hash while
    the other copy is live, and the blocks the second copy computes afterwards must be reachable."""
    manager, hasher = make(manager_blocks=6)
    events = []
    manager.events.subscribe(events.append)
    tokens = [4] * 9
    a, b = CacheRequest("a", tokens, hasher), CacheRequest("b", tokens, hasher)
    for r in (a, b):  # both admitted before either registered (same scheduler step)
        hits, n = manager.get_computed_blocks(r)
        assert n == 0
        manager.allocate_slots(r, r.num_tokens, hits)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        manager.cache_blocks(r, r.num_tokens)
    h = a.block_hashes
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [h[:2]]  # the hash appeared once
    manager.free(a)
    # Evict a's copies: the filler takes every free block (a's three, then the unused ones).
    filler = CacheRequest("f", [9] * 12, hasher)
    assert manager.allocate_slots(filler, 12) is not None
    assert not any(isinstance(e, BlockRemoved) for e in events)  # b's copies still serve both hashes
    c = CacheRequest("c", tokens, hasher)
    hits, n = manager.get_computed_blocks(c)
    assert n == 8 and hits == manager.req_to_blocks["b"][:2]
    # b goes on to fill its third block: it chains on b's copies and is reachable.
    b.append_token_ids([5, 6, 7])
    manager.allocate_slots(b, 3)
    b.num_computed_tokens = b.num_tokens
    manager.cache_blocks(b, b.num_tokens)
    d = CacheRequest("d", [*tokens, 5, 6, 7, 8], hasher)
    assert manager.get_computed_blocks(d)[1] == 12
    manager.free(filler)
    manager.free(b)
    assert manager.pool.num_free_blocks == 6


def test_a_released_copy_gives_up_its_hash_and_the_hash_goes_once():
    manager, hasher = make(manager_blocks=4)
    events = []
    manager.events.subscribe(events.append)
    a, b = CacheRequest("a", [4] * 5, hasher), CacheRequest("b", [4] * 5, hasher)
    for r in (a, b):
        manager.allocate_slots(r, 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        manager.cache_blocks(r, 5)
        manager.free(r)
    # b's copy gave up its hash when released (a's block serves it): it is reused first, before any cached block.
    assert next(iter(manager.pool.free_queue)).block_hash is None
    manager.allocate_slots(CacheRequest("f", [9] * 16, hasher), 16)
    assert [e for e in events if isinstance(e, BlockRemoved)] == [BlockRemoved([a.block_hashes[0]])]
    assert manager.pool.get_cached_block(a.block_hashes[0]) is None
    assert manager.stats.evictions == 1


def test_counters_are_in_tokens():
    manager, hasher = make()
    a = CacheRequest("a", list(range(10)), hasher)
    admit_and_run(manager, a)
    manager.free(a)
    b = CacheRequest("b", list(range(10)) + [77], hasher)
    admit_and_run(manager, b)
    s = manager.stats
    assert (s.queries, s.hits, s.requests) == (10 + 11, 8, 2)
    assert s.hit_rate == pytest.approx(8 / 21)


def test_generated_tokens_register_blocks_for_multi_turn():
    manager, hasher = make()
    turn1 = CacheRequest("t1", [1, 2, 3], hasher)
    admit_and_run(manager, turn1)
    turn1.append_token_ids([4, 5, 6, 7, 8])  # the reply completes block 0 and block 1
    manager.allocate_slots(turn1, 5)
    turn1.num_computed_tokens = turn1.num_tokens
    manager.cache_blocks(turn1, turn1.num_computed_tokens)
    manager.free(turn1)
    turn2 = CacheRequest("t2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hasher)
    assert manager.get_computed_blocks(turn2)[1] == 8


def test_caching_off_means_no_lookup_no_registration_same_allocation():
    on, hasher = make(caching=True)
    off, _ = make(caching=False)
    for manager in (on, off):
        a = CacheRequest("a", list(range(9)), hasher)
        admit_and_run(manager, a)
        assert len(manager.get_block_ids("a")) == 3
        manager.free(a)
    assert off.pool.cached_blocks == {}
    assert off.get_computed_blocks(CacheRequest("b", list(range(9)), hasher)) == ([], 0)
    assert on.get_computed_blocks(CacheRequest("b", list(range(9)), hasher))[1] == 8


def test_trace_requests_use_given_hashes():
    manager = KVCacheManager(8, 16)
    a = CacheRequest.from_block_hashes("a", [11, 12], num_tokens=40, block_size=16)
    admit_and_run(manager, a)
    manager.free(a)
    b = CacheRequest.from_block_hashes("b", [11, 13], num_tokens=33, block_size=16)
    assert manager.get_computed_blocks(b)[1] == 16
    with pytest.raises(ValueError, match="3 block hashes for 40 tokens"):
        CacheRequest.from_block_hashes("c", [1, 2, 3], num_tokens=40, block_size=16)


def test_double_free_is_an_error_not_a_negative_ref_count():
    manager, hasher = make()
    a = CacheRequest("a", [1] * 5, hasher)
    admit_and_run(manager, a)
    blocks = list(manager.req_to_blocks["a"])
    manager.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        manager.pool.free(blocks[:1])
    assert all(b.ref_cnt == 0 for b in manager.pool.blocks)


def test_a_request_hashed_in_another_block_size_is_refused():
    manager = KVCacheManager(16, 16)
    request = CacheRequest("a", list(range(40)), BlockHasher(4))
    with pytest.raises(ValueError, match="4-token blocks, but this cache's blocks hold 16"):
        manager.get_computed_blocks(request)
    trace_request = CacheRequest.from_block_hashes("t", [1, 2], num_tokens=8, block_size=4)
    with pytest.raises(ValueError, match="4-token blocks"):
        manager.get_computed_blocks(trace_request)


def test_a_preempted_request_is_counted_once():
    """Re-admission after preemption is no prefix sharing: it goes to the preempted counters."""
    manager, hasher = make()
    a = CacheRequest("a", list(range(10)), hasher)
    admit_and_run(manager, a)
    manager.free(a)  # preempted: its blocks stay cached
    a.num_computed_tokens = 0
    admit_and_run(manager, a)
    s = manager.stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 10, 8)
    assert a.num_cached_tokens == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    manager, hasher = make(manager_blocks=8)
    parent = CacheRequest("p", list(range(10)), hasher)  # 2 full blocks and 2 tokens of a third
    admit_and_run(manager, parent)
    full, partial = manager.req_to_blocks["p"][:2], manager.req_to_blocks["p"][2]
    child = CacheRequest("c", list(range(10)), hasher)
    child.num_computed_tokens = 10
    copies = manager.fork(parent, child)
    child_blocks = manager.req_to_blocks["c"]
    assert child_blocks[:2] == full and [b.ref_cnt for b in full] == [2, 2]
    assert copies == [(partial.block_id, child_blocks[2].block_id)] and child_blocks[2] is not partial
    assert partial.ref_cnt == 1 and child_blocks[2].ref_cnt == 1 and child_blocks[2].block_hash is None
    # The child registers its blocks from where the parent had: the third one once it is full.
    child.append_token_ids([10, 11])
    child.num_computed_tokens = 12
    manager.cache_blocks(child, 12)
    assert child_blocks[2].block_hash == child.block_hashes[2] and partial.block_hash is None
    manager.free(parent)
    manager.free(child)
    assert manager.pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in manager.pool.blocks)


def test_fork_of_full_blocks_copies_nothing_and_a_full_pool_changes_nothing():
    manager, hasher = make(manager_blocks=3)
    parent = CacheRequest("p", list(range(8)), hasher)  # exactly 2 blocks
    admit_and_run(manager, parent)
    child = CacheRequest("c", list(range(8)), hasher)
    assert manager.fork(parent, child) == [] and [b.ref_cnt for b in manager.req_to_blocks["c"]] == [2, 2]
    other = CacheRequest("o", list(range(50, 59)), hasher)  # 2 full blocks and a partial one
    manager.allocate_slots(other, 1)  # takes the last free block
    other.num_computed_tokens = 1
    tail = CacheRequest("t", [50], hasher)
    before = state(manager)
    assert manager.fork(other, tail) is None and state(manager) == before  # no block for the copy
