"""BlockHashMemo: the same hashes as BlockHasher.hash_blocks for any prompt, whatever the memo holds (shared
prefixes, other namespaces, evictions), and it hashes a shared prefix only once."""

import random

import pytest

from kvprefix.cache import HASH_ALGOS, BlockHasher, BlockHashMemo

BS = 4


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts of any length over a few shared prefixes, so that runs are shared, diverge mid-run and at a run's
    edge, and end in partial runs and partial blocks."""
    bases = [[rng.randrange(50) for _ in range(rng.randrange(0, 12 * BS))] for _ in range(4)]
    out = []
    for _ in range(n):
        base = rng.choice(bases)[: rng.randrange(0, 12 * BS + 1)]
        out.append(base + [rng.randrange(50) for _ in range(rng.randrange(0, 3 * BS))])
    return out


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_memoized_hashes_equal_the_hashers_own(algo):
    rng = random.Random(algo)
    base = BlockHasher(BS, algo)
    memo = BlockHashMemo(BS, algo, capacity_runs=5, run_blocks=2)  # small: entries are evicted all the time
    salted = [base, base.with_salt("tenant-a"), base.with_salt("tenant-b")]
    for tokens in prompts(rng, 400):
        hasher = rng.choice(salted)
        assert memo.hash_blocks(hasher, tokens) == hasher.hash_blocks(tokens)
    assert len(memo) == 5


def test_a_shared_prefix_is_hashed_once():
    calls = []

    class Counting(BlockHasher):
        def hash_blocks(self, token_ids, parent=None, first_block_index=0, extras=None):
            calls.append(len(token_ids) // self.block_size)
            return super().hash_blocks(token_ids, parent, first_block_index, extras)

    hasher = Counting(BS)
    memo = BlockHashMemo(BS, "sha256", run_blocks=4)
    system = list(range(10 * BS))  # two full runs and two blocks
    memo.hash_blocks(hasher, system + [1] * BS)
    assert sum(calls) == 11
    calls.clear()
    assert memo.hash_blocks(hasher, system + [2] * BS) == BlockHasher(BS).hash_blocks(system + [2] * BS)
    assert calls == [3]  # the two runs came from the memo: only the blocks after them were hashed


def test_a_memo_refuses_another_block_size_or_algorithm():
    memo = BlockHashMemo(BS, "sha256")
    with pytest.raises(ValueError, match="sha256 hashes of 4-token blocks"):
        memo.hash_blocks(BlockHasher(8), list(range(64)))
    with pytest.raises(ValueError, match="not xxhash"):
        memo.hash_blocks(BlockHasher(BS, "xxhash"), list(range(64)))
