"""Eviction isolation between groups (tenants), on real managers: the "prime and probe" of docs/security.md.

B primes the pool with his prompts, A sends (or not), B re-sends his prompts and reads his hits. With isolation
B's hits must not depend on A's request while A stays within its share; with one LRU they count A's blocks.
"""

import random

import pytest

from kvprefix.cache import BlockHasher, CacheRequest, KVCacheManager

BS = 4
NUM_BLOCKS = 40  # reserve 0.5 with two groups: 10 blocks each, B may cache 30 while A is owed its 10
HASHERS = {t: BlockHasher(BS).for_namespace(t, None) for t in ("alice", "bob")}


class Pool:
    def __init__(self, reserve_fraction: float):
        self.manager = KVCacheManager(NUM_BLOCKS, BS, reserve_fraction=reserve_fraction)
        self.count = 0

    def start(self, tenant: str, tokens: list[int]) -> CacheRequest:
        """Admits a request of ``tenant`` and computes its prompt; it holds its blocks until finished."""
        self.count += 1
        req = CacheRequest(f"r{self.count}", tokens, HASHERS[tenant], eviction_group=tenant)
        hits, n = self.manager.get_computed_blocks(req)
        assert self.manager.allocate_slots(req, req.num_tokens - n, hits) is not None
        req.num_computed_tokens = req.num_tokens
        self.manager.cache_blocks(req, req.num_tokens)
        return req

    def send(self, tenant: str, tokens: list[int]) -> int:
        """One whole request of ``tenant``; returns its cached tokens."""
        req = self.start(tenant, tokens)
        self.manager.free(req)
        return req.num_cached_tokens


def bob_prompts(n=10, blocks=4):
    """Prompts of ``blocks`` full blocks plus one token (every full block can hit)."""
    return [[100 + i] * (blocks * BS) + [7] for i in range(n)]


def alice_prompt(blocks: int) -> list[int]:
    return [1 + (j % 5) for j in range(blocks * BS)] + [9]


def bob_view(
    reserve_fraction: float, alice_blocks: int | None, alice_known: bool = True, alice_running: bool = False
) -> list[int]:
    """What B observes: his cached tokens for each re-sent prompt after A sent ``alice_blocks`` blocks (None:
    nothing). ``alice_known``: A sent a one-block request before B primed. ``alice_running``: A's request starts
    before B primes and runs (holding its blocks) until B has probed."""
    pool = Pool(reserve_fraction)
    if alice_known:
        pool.send("alice", [50] * BS + [1])
    if alice_running and alice_blocks is not None:
        pool.start("alice", alice_prompt(alice_blocks))
    for p in bob_prompts():
        pool.send("bob", p)
    if not alice_running and alice_blocks is not None:
        pool.send("alice", alice_prompt(alice_blocks))
    return [pool.send("bob", p) for p in reversed(bob_prompts())]  # newest first: a miss evicts the oldest


def test_one_lru_lets_bob_count_alices_blocks():
    quiet = bob_view(0.0, None)
    assert bob_view(0.0, 3) != quiet
    # What he lost is (about) what she sent: a larger prompt costs him more.
    assert sum(bob_view(0.0, 8)) < sum(bob_view(0.0, 3)) < sum(quiet)


@pytest.mark.parametrize("alice_blocks", [1, 3, 8])
def test_bobs_hits_do_not_depend_on_alice_within_her_share(alice_blocks):
    # Her earlier one-block prompt, this one and its partial block fit in her 10 reserved blocks.
    quiet = bob_view(0.5, None)
    assert sum(quiet) > 0
    assert bob_view(0.5, alice_blocks) == quiet


def test_alices_running_request_does_not_change_bobs_evictions():
    quiet = bob_view(0.5, None)
    assert all(bob_view(0.5, k, alice_running=True) == quiet for k in (1, 8))
    assert bob_view(0.0, 8, alice_running=True) != bob_view(0.0, None)


def test_a_first_request_shows_a_new_group_but_not_its_length():
    # Unknown until now, A's first request takes her reservation from B at once: the same for any length.
    views = {tuple(bob_view(0.5, k, alice_known=False)) for k in (1, 4, 9)}
    assert len(views) == 1
    assert views != {tuple(bob_view(0.5, None, alice_known=False))}


def test_beyond_her_share_alice_is_visible_again():
    assert bob_view(0.5, 20) != bob_view(0.5, None)


def test_a_group_within_its_share_keeps_its_cache_through_another_groups_flood():
    for reserve, survives in ((0.5, True), (0.0, False)):
        pool = Pool(reserve)
        prompt = alice_prompt(6)
        pool.send("alice", prompt)
        for p in bob_prompts(30):
            pool.send("bob", p)
        assert (pool.send("alice", prompt) == 6 * BS) is survives


def test_a_running_request_is_not_refused_while_blocks_are_free_it_borrows_owed_room():
    pool = Pool(0.5)
    pool.send("alice", [50] * BS + [1])  # alice is owed 9 more of her 10 blocks
    bob = pool.start("bob", [8] * (35 * BS))  # 35 blocks: 5 more than bob may hold without borrowing
    assert len(pool.manager.get_block_ids(bob.request_id)) == 35
    pool.manager.free(bob)
    groups = pool.manager.pool.groups
    assert groups.clean.num_free_blocks >= groups.owed  # given back on release: his blocks over the line evicted
    assert pool.send("alice", alice_prompt(8)) == 0 and pool.send("bob", [8] * (35 * BS)) > 0


def random_requests(seed: int, n: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    return [rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))] for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_one_group_with_isolation_on_is_the_plain_lru(seed):
    runs = []
    for reserve in (0.0, 0.5):
        manager = KVCacheManager(NUM_BLOCKS, BS, reserve_fraction=reserve)
        hasher = BlockHasher(BS)
        hits = []
        for i, tokens in enumerate(random_requests(seed)):
            req = CacheRequest(f"r{i}", tokens, hasher)
            found, n = manager.get_computed_blocks(req)
            assert manager.allocate_slots(req, req.num_tokens - n, found) is not None
            req.num_computed_tokens = req.num_tokens
            manager.cache_blocks(req, req.num_tokens)
            hits.append((n, manager.get_block_ids(req.request_id)))
            manager.free(req)
        runs.append((hits, manager.stats.snapshot()))
    assert runs[0] == runs[1]


def test_reset_forgets_every_groups_blocks_but_not_the_groups():
    pool = Pool(0.5)
    pool.send("alice", alice_prompt(3))
    pool.send("bob", bob_prompts(1)[0])
    assert pool.manager.reset_prefix_cache()
    groups = pool.manager.pool.groups
    assert (groups.footprint("alice"), groups.footprint("bob"), groups.reserved) == (0, 0, 10)
    assert pool.manager.pool.num_free_blocks == NUM_BLOCKS
    assert pool.send("alice", alice_prompt(3)) == 0


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_reserve_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="reserve_fraction"):
        KVCacheManager(NUM_BLOCKS, BS, reserve_fraction=bad)
