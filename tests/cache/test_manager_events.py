"""The KV cache manager's events: what each change publishes, resets, salted namespaces, and subscribers that
unsubscribe or raise."""

import pytest
from support.managers import BS, admit_and_run, make

from kvprefix.cache import AllBlocksCleared, BlockRemoved, BlockStored, CacheRequest


def test_reset_refuses_while_blocks_are_held_and_emits_clear_after():
    manager, hasher = make()
    events = []
    manager.events.subscribe(events.append)
    r = CacheRequest("r", list(range(9)), hasher)
    admit_and_run(manager, r)
    assert manager.reset_prefix_cache() is False
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    assert manager.pool.get_cached_block(r.block_hashes[0]) is not None
    manager.free(r)
    assert manager.reset_prefix_cache() is True
    assert isinstance(events[-1], AllBlocksCleared)
    assert manager.pool.cached_blocks == {}
    assert manager.get_computed_blocks(CacheRequest("s", list(range(9)), hasher)) == ([], 0)


def test_events_match_what_happened():
    manager, hasher = make(manager_blocks=3)
    events = []
    unsubscribe = manager.events.subscribe(events.append)
    a = CacheRequest("a", list(range(9)), hasher)
    admit_and_run(manager, a)
    assert events == [
        BlockStored(
            block_hashes=a.block_hashes[:2],
            parent_block_hash=hasher.root,  # the first block's parent is its namespace's root
            token_ids=list(range(8)),
            block_size=BS,
            extra_keys=None,
            namespace=hasher.namespace_id,
        )
    ]
    # Generated tokens that complete the third block are registered too, with the second block as parent.
    a.append_token_ids([100, 101, 102])
    manager.allocate_slots(a, 3)
    a.num_computed_tokens = a.num_tokens
    manager.cache_blocks(a, a.num_computed_tokens)
    assert events[1] == BlockStored(
        [a.block_hashes[2]], a.block_hashes[1], [8, 100, 101, 102], BS, None, hasher.namespace_id
    )
    manager.free(a)
    b = CacheRequest("b", [50] * 4, hasher)
    manager.allocate_slots(b, 4)
    # All three blocks are cached; tail-first release makes the third block the least recently released.
    assert events[2] == BlockRemoved([a.block_hashes[2]])
    unsubscribe()
    manager.free(b)
    manager.reset_prefix_cache()
    assert len(events) == 3


def test_unsubscribing_during_publish_skips_no_subscriber():
    """Subscribers are copy-on-write: publish iterates the list it started with, so a callback (or another thread)
    that unsubscribes does not make it skip the next subscriber."""
    from kvprefix.cache import EventPublisher

    publisher = EventPublisher()
    seen = []
    unsubscribe_first = publisher.subscribe(lambda e: (seen.append("first"), unsubscribe_first()))
    publisher.subscribe(lambda e: seen.append("second"))
    publisher.publish(AllBlocksCleared())
    publisher.flush()
    assert seen == ["first", "second"]
    publisher.publish(AllBlocksCleared())
    publisher.flush()
    assert seen == ["first", "second", "second"]
    assert publisher.active


def test_salted_stored_events_name_the_namespace_not_the_salt():
    manager, hasher = make()
    events = []
    manager.events.subscribe(events.append)
    salted = hasher.with_salt("secret-salt")
    admit_and_run(manager, CacheRequest("a", list(range(9)), salted))
    (event,) = events
    assert event.namespace == salted.namespace_id != hasher.namespace_id
    assert event.parent_block_hash == salted.root
    assert "secret-salt" not in repr(event)


def test_a_subscriber_that_raises_leaks_no_blocks():
    """Events reach subscribers only after the manager recorded the blocks, so freeing the request frees them."""
    manager, hasher = make(manager_blocks=3)

    def failing(event):
        raise RuntimeError("subscriber bug")

    manager.events.subscribe(failing)
    a = CacheRequest("a", list(range(9)), hasher)
    with pytest.raises(RuntimeError, match="subscriber bug"):
        admit_and_run(manager, a)  # BlockStored raises in cache_blocks
    manager.free(a)
    b = CacheRequest("b", [50] * 12, hasher)
    with pytest.raises(RuntimeError, match="subscriber bug"):
        manager.allocate_slots(b, 12)  # evicting a's blocks: BlockRemoved raises
    assert manager.get_block_ids("b") != []
    manager.free(b)
    assert manager.pool.num_free_blocks == 3
    assert all(blk.ref_cnt == 0 for blk in manager.pool.blocks)
