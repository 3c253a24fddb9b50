"""Random interleavings of scheduler actions against a shadow copy of what each block holds.

The shadow records, per block id, the tokens a request wrote into it. A hit is correct only if the shadow of
every hit block equals the request's own tokens at those positions; a referenced block handed to someone else
would be overwritten in the shadow and break that check for its owner. The same machine runs once more on a
pool with eviction groups (two groups; one of them spans two salts), which must also keep its group accounts.
"""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvprefix.cache import BlockHasher, BlockRemoved, BlockStored, CacheRequest, KVCacheManager

BS = 4
NUM_BLOCKS = 12
PREFIXES = [[1] * 10, [1] * 6 + [2] * 6, [3, 4, 5, 6, 7, 8, 9]]
GROUP_OF_SALT = {"": None, "t2": "b", "t3": "b"}


class CacheMachine(RuleBasedStateMachine):
    RESERVE = 0.0

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BS, reserve_fraction=self.RESERVE)
        self.hashers = {salt: BlockHasher(BS).with_salt(salt) for salt in GROUP_OF_SALT}
        self.joined: set = set()  # groups that have allocated: they are owed their share
        self.shadow: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.running: dict[str, CacheRequest] = {}
        self.waiting: list[CacheRequest] = []
        self.cached_hashes: set = set()  # the reference model of the hash map, driven by events
        self.manager.events.subscribe(self._on_event)
        self.counter = 0

    def _on_event(self, event):
        if isinstance(event, BlockStored):
            assert not self.cached_hashes & set(event.block_hashes)
            self.cached_hashes |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= self.cached_hashes
            self.cached_hashes -= set(event.block_hashes)
        else:
            self.cached_hashes.clear()

    def _write(self, req: CacheRequest, start: int, end: int) -> None:
        """The model step: write tokens [start, end) of the request into its blocks' slots."""
        table = self.manager.get_block_ids(req.request_id)
        for pos in range(start, end):
            self.shadow[table[pos // BS]][pos % BS] = req.token_ids[pos]

    def _admit(self, req: CacheRequest, chunk: int) -> bool:
        hits, n = self.manager.get_computed_blocks(req)
        for i, block in enumerate(hits):
            assert self.shadow[block.block_id] == req.token_ids[i * BS : (i + 1) * BS], "hit on wrong tokens"
            assert block.block_hash == req.block_hashes[i]
        num_new = min(chunk, req.num_tokens - n)
        if self.manager.allocate_slots(req, num_new, hits) is None:
            return False
        self.joined.add(req.eviction_group)
        assert req.num_computed_tokens == n
        self._compute(req, num_new)
        self.running[req.request_id] = req
        return True

    def _compute(self, req: CacheRequest, num_new: int) -> None:
        start = req.num_computed_tokens
        self._write(req, start, start + num_new)
        req.num_computed_tokens += num_new
        self.manager.cache_blocks(req, req.num_computed_tokens)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from(sorted(GROUP_OF_SALT)),
        chunk=st.integers(1, 20),
    )
    def new_request(self, prefix, suffix, salt, chunk):
        self.counter += 1
        req = CacheRequest(f"r{self.counter}", prefix + suffix, self.hashers[salt], eviction_group=GROUP_OF_SALT[salt])
        if not self._admit(req, chunk):
            self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def step(self, data, chunk):
        """Continues a prefill chunk, or decodes one token once the prompt is done."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_computed_tokens < req.num_tokens:
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        else:
            req.append_token_ids([data.draw(st.integers(0, 3))])
            num_new = 1
        if self.manager.allocate_slots(req, num_new) is None:
            self._preempt(req)
            return
        self._compute(req, num_new)

    def _preempt(self, req: CacheRequest) -> None:
        self.manager.free(req)
        req.num_computed_tokens = 0
        del self.running[req.request_id]
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.manager.free(req)

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 20))
    def readmit(self, chunk):
        req = self.waiting.pop(0)
        if not self._admit(req, chunk):
            self.waiting.insert(0, req)

    @rule()
    def reset(self):
        ok = self.manager.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert not self.cached_hashes

    @invariant()
    def ref_counts_match_block_tables(self):
        counts = [0] * NUM_BLOCKS
        for rid in self.running:
            for block_id in self.manager.get_block_ids(rid):
                counts[block_id] += 1
        assert [b.ref_cnt for b in self.manager.pool.blocks] == counts
        free_ids = {b.block_id for b in self.manager.pool.free_queue}
        assert free_ids == {i for i, c in enumerate(counts) if c == 0}
        assert self.manager.pool.num_free_blocks == len(free_ids)

    @invariant()
    def running_requests_keep_their_tokens(self):
        for req in self.running.values():
            table = self.manager.get_block_ids(req.request_id)
            for pos in range(req.num_computed_tokens):
                assert self.shadow[table[pos // BS]][pos % BS] == req.token_ids[pos], "a held block was reused"

    @invariant()
    def hash_map_matches_events_and_blocks(self):
        cached = self.manager.pool.cached_blocks
        assert set(cached) == self.cached_hashes
        for block_hash, block in cached.items():
            assert block.block_hash == block_hash

    @invariant()
    def groups_count_their_blocks_and_clean_blocks_cover_the_owed_room(self):
        groups = self.manager.pool.groups
        if groups is None:
            return
        blocks = self.manager.pool.blocks
        held = Counter(b.group for b in blocks if b.ref_cnt or b.block_hash is not None)  # not clean
        assert set(held) <= self.joined
        assert {g: groups.footprint(g) for g in self.joined} == {g: held[g] for g in self.joined}
        if self.joined:
            assert groups.reserved == int(NUM_BLOCKS * self.RESERVE) // len(self.joined)
        assert groups.owed == sum(max(0, groups.reserved - held[g]) for g in self.joined)
        if NUM_BLOCKS - held.total() < groups.owed:  # borrowed: only while no block over a share can be evicted
            assert not any(b.ref_cnt == 0 and held[b.group] > groups.reserved for b in blocks if b.block_hash)

    def teardown(self):
        for req in list(self.running.values()):
            self.manager.free(req)
        pool = self.manager.pool
        assert pool.num_free_blocks == NUM_BLOCKS, "leaked blocks"
        assert all(b.ref_cnt == 0 for b in pool.blocks)


TestCacheMachine = pytest.mark.slow(CacheMachine.TestCase)
TestCacheMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class GroupedCacheMachine(CacheMachine):
    RESERVE = 0.5


TestGroupedCacheMachine = pytest.mark.slow(GroupedCacheMachine.TestCase)
TestGroupedCacheMachine.settings = TestCacheMachine.settings
