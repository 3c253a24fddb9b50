"""Block hashing: chaining, partial blocks, context and extra keys, algorithms, and a frozen byte encoding."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvprefix.cache import (
    HASH_ALGOS,
    BlockExtras,
    BlockHasher,
    ExecutionContext,
    LoraKey,
    MultiModalItem,
    leading_blocks_in,
    prompt_embeds_block_digests,
)

BS = 4
TOKENS = list(range(100, 100 + 5 * BS))  # five full blocks


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_change_in_block_k_changes_k_and_later_only(algo):
    hasher = BlockHasher(BS, algo)
    base = hasher.hash_blocks(TOKENS)
    assert len(set(base)) == 5
    for k in range(5):
        changed = list(TOKENS)
        changed[k * BS + 1] += 1
        other = hasher.hash_blocks(changed)
        assert other[:k] == base[:k]
        assert all(a != b for a, b in zip(other[k:], base[k:], strict=True))


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_partial_blocks_get_no_hash(algo):
    hasher = BlockHasher(BS, algo)
    assert hasher.hash_blocks(TOKENS[: BS - 1]) == []
    assert len(hasher.hash_blocks(TOKENS[: 2 * BS + 3])) == 2
    assert hasher.hash_blocks(TOKENS[: 2 * BS + 3]) == hasher.hash_blocks(TOKENS)[:2]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_incremental_equals_whole(algo):
    hasher = BlockHasher(BS, algo)
    whole = hasher.hash_blocks(TOKENS)
    first = hasher.hash_blocks(TOKENS[: 2 * BS])
    rest = hasher.hash_blocks(TOKENS[2 * BS :], parent=first[-1], first_block_index=2)
    assert first + rest == whole


@pytest.mark.parametrize("field", ["model", "revision", "tokenizer", "chat_template", "kv_dtype", "salt"])
def test_every_context_field_changes_every_hash(field):
    base_ctx = ExecutionContext("m", "r", "t", "c", "bf16", "")
    changed_ctx = ExecutionContext(**{**base_ctx.__dict__, field: "other"})
    base = BlockHasher(BS, context=base_ctx).hash_blocks(TOKENS)
    changed = BlockHasher(BS, context=changed_ctx).hash_blocks(TOKENS)
    assert not set(base) & set(changed)


def test_context_fields_cannot_be_shifted_into_each_other():
    a = BlockHasher(BS, context=ExecutionContext(model="ab", revision="c"))
    b = BlockHasher(BS, context=ExecutionContext(model="a", revision="bc"))
    assert a.root != b.root


def test_salted_hashers_are_memoized_and_bounded():
    hasher = BlockHasher(BS)
    a = hasher.with_salt("a")
    assert hasher.with_salt("a") is a and hasher.with_salt("") is hasher
    for i in range(2000):  # client-chosen salts must not grow memory without bound
        hasher.with_salt(f"s{i}")
    again = hasher.with_salt("a")
    assert again is not a and again.root == a.root


def test_with_salt_changes_only_the_salt():
    ctx = ExecutionContext("m", "r", "t", "c", "bf16", "")
    hasher = BlockHasher(BS, context=ctx)
    assert (
        hasher.with_salt("tenant-a").root
        == BlockHasher(BS, context=ExecutionContext("m", "r", "t", "c", "bf16", "tenant-a")).root
    )
    assert hasher.with_salt("tenant-a").root != hasher.with_salt("tenant-b").root
    assert hasher.with_salt("").root == hasher.root


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_each_extra_key_changes_the_hash(algo):
    hasher = BlockHasher(BS, algo)
    plain = hasher.hash_blocks(TOKENS)
    variants = {
        "lora": BlockExtras(lora=LoraKey("sql", "v1")),
        "lora reloaded": BlockExtras(lora=LoraKey("sql", "v2")),
        "mm": BlockExtras(mm_items=(MultiModalItem("img-aaa", offset=5, length=3),)),
        "mm other content": BlockExtras(mm_items=(MultiModalItem("img-bbb", offset=5, length=3),)),
        "mm other offset": BlockExtras(mm_items=(MultiModalItem("img-aaa", offset=6, length=3),)),
        "embeds": BlockExtras(prompt_embeds_digests=(b"\x01" * 32,)),
    }
    results = {name: hasher.hash_blocks(TOKENS, extras=extras) for name, extras in variants.items()}
    for name, hashes in results.items():
        assert hashes != plain, name
    assert len({tuple(h) for h in results.values()}) == len(results)
    # An image at positions 5..7 touches block 1 only: block 0 is unchanged, block 1 and later differ.
    mm = results["mm"]
    assert mm[0] == plain[0] and mm[1] != plain[1]
    # LoRA changes every block.
    assert all(a != b for a, b in zip(results["lora"], plain, strict=True))


def test_extra_key_kinds_are_domain_separated():
    # The same string as a LoRA name and as a multimodal hash must not give the same block key.
    lora = BlockExtras(lora=LoraKey("x", ""))
    mm = BlockExtras(mm_items=(MultiModalItem("x", offset=0, length=BS),))
    assert lora.keys_for_block(0, BS) != mm.keys_for_block(0, BS)
    hasher = BlockHasher(BS)
    assert hasher.hash_blocks(TOKENS, extras=lora)[0] != hasher.hash_blocks(TOKENS, extras=mm)[0]


def test_prompt_embeds_digests_follow_block_content():
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((2 * BS + 1, 8)).astype(np.float32)
    digests = prompt_embeds_block_digests(embeds, BS)
    assert len(digests) == 2
    changed = embeds.copy()
    changed[BS + 1, 3] += 1.0
    other = prompt_embeds_block_digests(changed, BS)
    assert other[0] == digests[0] and other[1] != digests[1]


def test_algorithms_differ_and_have_their_digest_sizes():
    sizes = {algo: len(BlockHasher(BS, algo).hash_blocks(TOKENS)[0]) for algo in HASH_ALGOS}
    assert sizes == {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
    firsts = {BlockHasher(BS, algo).hash_blocks(TOKENS)[0] for algo in HASH_ALGOS}
    assert len(firsts) == 4


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="md5"):
        BlockHasher(BS, "md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="-1"):
        BlockHasher(BS).hash_blocks([1, 2, 3, -1])


# Golden values: if the byte encoding in docs/hashing.md changes, these fail. Change them only with a new
# root domain version, because every router and stored event depends on the old values.
GOLDEN_CONTEXT = ExecutionContext("Qwen/Qwen2.5-0.5B", "main", "Qwen/Qwen2.5-0.5B", "v1", "bfloat16", "tenant-a")
GOLDEN_TOKENS = list(range(32))
GOLDEN = {
    "sha256": [
        "3c73f9a9b89fc7dbdaf41efe29a804210d784a90cd821b00554d05464f1d5167",
        "fffe3717eacc8b3d2df704f5d9538207484b4832f0beeb2c12c91579c411ad0f",
        "4520942ddc47dfa1af5207afff1e16eed38ae5c10d4bcb6525a17b5a91c4a94a",
        "8726086fbe972c25ca233168f14299a6e1afc1e0dd30e91b64c205c5d5bd4a47",
        "745dc39a10a28c547a445852ca5b14e34da7e14f5c7d9258c31eb254bec56ee5",
    ],
    "sha256_cbor": [
        "eacde15ea4b3d71cc83acd94e23d45e647431482e4b56d82e4fd02de230ce24c",
        "e830c415dba91fedf3a4cac370d9516056c8d22c1114ef1569a96f5fc447e543",
        "3fbaef8278cee5bbea04223e90082b7d3e7075dcee0e8416aa5a25f9da2b002c",
        "0dfbe7d4c600c6b68299722142b71e031c331aa4308c8032141cd83bf1e46b0d",
        "c3eb45a553e4163b33c0aa6b732c17416cb18cdf28272c6dd5c7a78aae40de8e",
    ],
    "xxhash": [
        "adcbe2c6b68650e83ab1b5b0347ac081",
        "f605850bb54c29f1ac0e079fdc57375f",
        "d094f4cc3833141165255411052db5d9",
        "99158038857fbd862f67e5961f166cd4",
        "8cd1df128ec91db71b94e268df2a2ddd",
    ],
    "xxhash_cbor": [
        "20320fa3d24643cc9b6d3e60a7a9a032",
        "68f10c6e7a22985434cee41adcd626fd",
        "68374d2ec77401cb0c1831beab9b946d",
        "f926e2098ccd7bbd5750964329866086",
        "9247d131444965ec996449b9ea7af3ab",
    ],
}


def golden_hashes() -> dict[str, list[str]]:
    out = {}
    for algo in HASH_ALGOS:
        hasher = BlockHasher(16, algo, GOLDEN_CONTEXT)
        extras = BlockExtras(lora=LoraKey("sql", "abc123"), mm_items=(MultiModalItem("img", 20, 4),))
        out[algo] = [hasher.root.hex()]
        out[algo] += [h.hex() for h in hasher.hash_blocks(GOLDEN_TOKENS)]
        out[algo] += [h.hex() for h in hasher.hash_blocks(GOLDEN_TOKENS, extras=extras)]
    return out


def test_golden_values():
    assert golden_hashes() == GOLDEN


def test_sha256_encoding_matches_the_spec_in_docs():
    """Recomputes the root and first block from docs/hashing.md with hashlib alone."""
    import hashlib
    import struct

    def field(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    root_payload = field(b"kvprefix/root/v1") + field(b"sha256")
    for name, value in GOLDEN_CONTEXT.fields():
        root_payload += field(name.encode()) + field(value.encode())
    root = hashlib.sha256(root_payload).digest()
    block0 = hashlib.sha256(root + b"T" + struct.pack("<I", 16) + struct.pack("<16I", *GOLDEN_TOKENS[:16])).digest()
    assert [root.hex(), block0.hex()] == GOLDEN["sha256"][:2]
    extras = (
        b"X" + struct.pack("<I", 1) + b"L" + field(b"sql") + field(b"abc123")
    )  # block 0 holds only the LoRA key: the image starts at token 20, in block 1
    block0_lora = hashlib.sha256(
        root + b"T" + struct.pack("<I", 16) + struct.pack("<16I", *GOLDEN_TOKENS[:16]) + extras
    ).digest()
    assert block0_lora.hex() == GOLDEN["sha256"][3]


def test_hashes_are_the_same_in_a_fresh_process_with_another_hash_seed():
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from test_hashing import golden_hashes; print(json.dumps(golden_hashes()))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, here], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == golden_hashes()


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_every_algorithm_refuses_the_same_token_ids(algo, bad):
    with pytest.raises(ValueError, match="not an integer in"):
        BlockHasher(BS, algo).hash_blocks([bad, 1, 2, 3])


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_numpy_token_ids_hash_like_python_ints(algo):
    hasher = BlockHasher(BS, algo)
    assert hasher.hash_blocks(np.array(TOKENS, dtype=np.int64)) == hasher.hash_blocks(TOKENS)
    assert hasher.hash_blocks(list(np.array(TOKENS, dtype=np.uint32))) == hasher.hash_blocks(TOKENS)
    assert hasher.hash_blocks([0, 2**32 - 1, 0, 1]) != []


@given(st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=6), st.lists(st.integers(0, 3),
       max_size=3), st.sets(st.integers(0, 3)), st.data())
def test_leading_blocks_in_by_scan_and_by_bisection(chains, suffix, drop_digits, data):
    """A chain's leading held blocks: the scan stops at the first block not held, whatever ``held`` is; bisection
    gives the same count when ``held`` is prefix-closed (whole chains of chained hashes, trimmed from their ends)."""
    hasher = BlockHasher(1, "xxhash")
    request = data.draw(st.sampled_from(chains)) + suffix  # shares a prefix with what is held, or more
    ask = hasher.hash_blocks(request)
    held = set()
    for tokens in chains:
        hashes = hasher.hash_blocks(tokens)
        held.update(hashes[: data.draw(st.integers(0, len(hashes)))])  # a chain evicted from its end
    expected = 0
    while expected < len(ask) and ask[expected] in held:
        expected += 1
    assert leading_blocks_in(held, ask) == expected
    assert leading_blocks_in(held, ask, prefix_closed=True) == expected
    # not prefix-closed (blocks dropped from the middle of chains): only the scan may be asked
    holey = {h for h, t in zip(ask, request, strict=True) if t not in drop_digits} | held
    expected = 0
    while expected < len(ask) and ask[expected] in holey:
        expected += 1
    assert leading_blocks_in(holey, ask) == expected
