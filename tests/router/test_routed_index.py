"""RoutedIndex keeps exactly the blocks a plain LRU list would (each request's blocks refreshed deepest first),
however its record step is written, and finds a chain's cached prefix as a scan block by block would."""

from __future__ import annotations

import random

from kvprefix.router.policies import RoutedIndex


def test_the_routed_index_holds_what_a_plain_lru_holds():
    rng = random.Random(11)
    index, lru, capacity = RoutedIndex(40), [], 40
    prefixes = [[f"p{k}-{i}" for i in range(rng.randrange(1, 25))] for k in range(5)]
    universe = {h for p in prefixes for h in p}
    recorded = []
    for n in range(500):
        chain = rng.choice(prefixes)[: rng.randrange(1, 26)] + [f"q{n}"] * rng.randrange(2)
        universe.update(chain)
        index.record(0, chain)
        for h in reversed(chain):  # the reference: refresh deepest first, then drop the least recent
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[: max(len(lru) - capacity, 0)]
        assert {h for h in universe if index.cached_prefix_blocks(0, [h])} == set(lru)
        recorded.append(chain)
        probe = rng.choice(recorded[-60:])[: rng.randrange(1, 27)] + [f"new{n}"] * rng.randrange(2)  # chained
        held = 0  # a chain's cached prefix, block by block (the index finds it by bisection)
        while held < len(probe) and probe[held] in lru:
            held += 1
        assert index.cached_prefix_blocks(0, probe) == held
