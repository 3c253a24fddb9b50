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


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_a_shared_prefix_is_hashed_once(algo):
    hasher = BlockHasher(BS, algo)
    digests = []
    digest = hasher._digest
    hasher._digest = lambda payload: digests.append(payload) or digest(payload)  # counts the blocks hashed
    memo = BlockHashMemo(BS, algo, run_blocks=4)
    system = list(range(10 * BS))  # two full runs and two blocks
    memo.hash_blocks(hasher, system + [1] * BS)
    assert len(digests) == 11
    digests.clear()
    assert memo.hash_blocks(hasher, system + [2] * BS) == BlockHasher(BS, algo).hash_blocks(system + [2] * BS)
    assert len(digests) == 1  # the two runs and the two blocks after them came from the memo: only the new one
    digests.clear()
    memo.hash_blocks(hasher, system[: 9 * BS] + [3] * BS)
    assert len(digests) == 1  # a prompt that changes inside the system prompt's last blocks: only from there


def test_a_memo_refuses_another_block_size_or_algorithm():
    memo = BlockHashMemo(BS, "sha256")
    with pytest.raises(ValueError, match="sha256 hashes of 4-token blocks"):
        memo.hash_blocks(BlockHasher(8), list(range(64)))
    with pytest.raises(ValueError, match="not xxhash"):
        memo.hash_blocks(BlockHasher(BS, "xxhash"), list(range(64)))


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_a_prompt_that_differs_from_the_last_one_anywhere_hashes_like_the_hasher(algo):
    """The blocks shared with the previous prompt come from its hashes: a change in any block (or a caller that
    changes its list after hashing it) still gives the hasher's own hashes from that block on."""
    hasher = BlockHasher(BS, algo)
    memo = BlockHashMemo(BS, algo, run_blocks=3)
    base = list(range(9 * BS + 2))
    for block in range(9):
        for offset in (0, BS - 1):
            changed = list(base)
            changed[block * BS + offset] += 100
            for tokens in (base, changed, changed[: (block + 1) * BS], tuple(changed)):
                assert memo.hash_blocks(hasher, tokens) == hasher.hash_blocks(tokens)
    tokens = list(base)
    memo.hash_blocks(hasher, tokens)
    tokens[5] = 999  # the memo kept a copy, not the caller's list
    assert memo.hash_blocks(hasher, tokens) == hasher.hash_blocks(tokens)
    assert memo.hash_blocks(hasher.with_salt("other"), tokens) == hasher.with_salt("other").hash_blocks(tokens)
