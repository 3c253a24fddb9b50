"""Parent-chained block hashes: h_i = H(h_{i-1}, tokens of block i, extra keys of block i).

The byte encoding is specified in docs/hashing.md and pinned by golden values in tests/cache/test_hashing.py.
It depends only on its inputs: no Python ``hash()``, no pickle, no per-process seed, so a router in another
process (or on another machine) computes the same hashes as the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass

import cbor2
import xxhash

from kvprefix.cache.identity import ExecutionContext, namespace_id, namespace_salt

BlockHash = bytes

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# xxh3-128 is fast but not collision resistant: a crafted prompt could alias another tenant's block.
COLLISION_SAFE_ALGOS = ("sha256", "sha256_cbor")

_ROOT_DOMAIN = b"kvprefix/root/v1"
_TOKEN_TAG = b"T"
_EXTRA_TAG = b"X"
_LORA_TAG = b"L"
_MM_TAG = b"M"
_EMBEDS_TAG = b"E"
_MAX_TOKEN_ID = 2**32 - 1
_MAX_SALTED_HASHERS = 1024  # per base hasher, least recently used dropped first


def leading_blocks_in(held: Container[Hashable], block_hashes: Sequence[Hashable], prefix_closed: bool = False) -> int:
    """How many leading blocks of a chain ``held`` holds (up to the first it does not).

    ``prefix_closed``: the caller knows ``held`` holds the blocks before any block it holds (whole chains go in, a
    chain's deepest blocks go out first; hashes are chained, so a block's predecessors are the same in every chain).
    Then the held blocks of a chain are a prefix of it, found by bisection: a few lookups instead of one per block."""
    n = len(block_hashes)
    if not prefix_closed:
        for i, h in enumerate(block_hashes):
            if h not in held:
                return i
        return n
    if not n or block_hashes[0] not in held:
        return 0
    if block_hashes[-1] in held:
        return n
    lo, hi = 1, n - 1  # block lo - 1 is held, block hi is not
    while lo < hi:
        mid = (lo + hi) // 2
        if block_hashes[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _field(data: bytes) -> bytes:
    """Length-prefixed bytes, so that concatenated fields can never be re-split differently."""
    return _u32(len(data)) + data


@dataclass(frozen=True)
class LoraKey:
    """A LoRA adapter, by name and version (a checksum), so a reloaded adapter under the same name misses."""

    name: str
    version: str


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions [offset, offset + length), identified by its content hash."""

    content_hash: str
    offset: int
    length: int


@dataclass(frozen=True)
class BlockExtras:
    """Per-request inputs, other than token ids, that make a block's KV different."""

    lora: LoraKey | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    # One digest per prompt token block, for prompts given as embeddings (see prompt_embeds_block_digests).
    prompt_embeds_digests: tuple[bytes, ...] = ()

    def is_empty(self) -> bool:
        return self.lora is None and not self.mm_items and not self.prompt_embeds_digests

    def keys_for_block(self, block_index: int, block_size: int) -> list[tuple]:
        """The typed extra keys of one block, in the canonical order: lora, multimodal items, embeddings."""
        keys: list[tuple] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.version))
        start, end = block_index * block_size, (block_index + 1) * block_size
        for item in self.mm_items:
            if item.offset < end and item.offset + item.length > start:
                keys.append(("mm", item.content_hash, item.offset - start))
        if block_index < len(self.prompt_embeds_digests):
            keys.append(("embeds", self.prompt_embeds_digests[block_index]))
        return keys


def prompt_embeds_block_digests(embeds, block_size: int) -> tuple[bytes, ...]:
    """SHA-256 of each full block of a prompt-embeddings array (numpy, shape [tokens, hidden])."""
    import numpy as np

    arr = np.ascontiguousarray(embeds)
    header = _field(str(arr.dtype).encode()) + _u32(arr.shape[1] if arr.ndim > 1 else 1)
    return tuple(
        hashlib.sha256(header + arr[i : i + block_size].tobytes()).digest()
        for i in range(0, (len(arr) // block_size) * block_size, block_size)
    )


def _encode_extra_keys(keys: list[tuple]) -> bytes:
    out = [_EXTRA_TAG, _u32(len(keys))]
    for key in keys:
        kind = key[0]
        if kind == "lora":
            out += [_LORA_TAG, _field(key[1].encode()), _field(key[2].encode())]
        elif kind == "mm":
            out += [_MM_TAG, _field(key[1].encode()), struct.pack("<q", key[2])]
        elif kind == "embeds":
            out += [_EMBEDS_TAG, _field(key[1])]
        else:
            raise ValueError(f"unknown extra key kind {kind!r}")
    return b"".join(out)


def _token_array(token_ids: Sequence[int]) -> array:
    """Token ids as uint32, the one validation for every algorithm: ints (numpy's too) in [0, 2**32)."""
    try:
        if type(token_ids) is list:  # fromlist converts a list about twice as fast as the constructor
            arr = array("I")
            arr.fromlist(token_ids)
        else:
            arr = array("I", token_ids)
    except (OverflowError, TypeError):
        bad = next((t for t in token_ids if not (_is_int(t) and 0 <= t <= _MAX_TOKEN_ID)), None)
        raise ValueError(f"token id {bad!r} is not an integer in [0, 2**32)") from None
    if arr.itemsize != 4:  # pragma: no cover - no mainstream platform has a non-32-bit C unsigned int
        arr = array("L", arr)
    return arr


def _is_int(t) -> bool:
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def _token_bytes(arr: array) -> bytes:
    """Little-endian uint32, the same bytes on every machine."""
    if sys.byteorder == "big":  # pragma: no cover
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo.startswith("sha256"):
        return lambda data: hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest


class BlockHasher:
    """Hashes full token blocks for one execution context with one algorithm.

    ``root`` is h_{-1}. ``hash_blocks`` hashes the full blocks of a token list, continuing a chain from any parent.
    """

    def __init__(self, block_size: int, algo: str = "sha256", context: ExecutionContext | None = None):
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix_caching_hash_algo {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.context = context or ExecutionContext()
        self._cbor = algo.endswith("_cbor")
        self._digest = _digest_fn(algo)
        self._token_header = _TOKEN_TAG + _u32(block_size)
        self.root = self._root_hash()
        self.namespace_id = namespace_id(self.root)
        self._salted: OrderedDict[str, BlockHasher] = OrderedDict()
        self._salted_lock = threading.Lock()

    def _root_hash(self) -> BlockHash:
        if self._cbor:
            payload = cbor2.dumps([_ROOT_DOMAIN.decode(), self.algo, dict(self.context.fields())], canonical=True)
        else:
            parts = [_field(_ROOT_DOMAIN), _field(self.algo.encode())]
            for name, value in self.context.fields():
                parts += [_field(name.encode()), _field(value.encode())]
            payload = b"".join(parts)
        return self._digest(payload)

    def with_salt(self, salt: str) -> BlockHasher:
        """The hasher for the same context under ``salt``. Memoized (bounded, thread-safe): salts come from
        clients, and each new hasher hashes its root."""
        if salt == self.context.salt:
            return self
        with self._salted_lock:
            hasher = self._salted.get(salt)
            if hasher is not None:
                self._salted.move_to_end(salt)
                return hasher
        hasher = BlockHasher(self.block_size, self.algo, dataclasses.replace(self.context, salt=salt))
        with self._salted_lock:
            self._salted[salt] = hasher
            if len(self._salted) > _MAX_SALTED_HASHERS:
                self._salted.popitem(last=False)
        return hasher

    def for_namespace(self, tenant: str | None, cache_salt: str | None, lora: str | None = None) -> BlockHasher:
        """The hasher of a tenant's (and client salt's, and LoRA adapter's) namespace: see
        ``identity.namespace_salt``."""
        return self.with_salt(namespace_salt(tenant, cache_salt, lora))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
        first_block_index: int = 0,
        extras: BlockExtras | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` (a partial tail gets none).

        ``parent`` is the hash of the block before ``token_ids[0]`` (None: the root) and ``first_block_index`` its
        position in the request, which locates the per-block extra keys.
        """
        bs = self.block_size
        num_full = len(token_ids) // bs
        if num_full == 0:
            return []
        prev = self.root if parent is None else parent
        with_extras = extras is not None and not extras.is_empty()
        tokens = _token_array(token_ids[: num_full * bs])
        out: list[BlockHash] = []
        if self._cbor:
            for i in range(num_full):
                keys = extras.keys_for_block(first_block_index + i, bs) if with_extras else []
                payload = cbor2.dumps([prev, tokens[i * bs : (i + 1) * bs].tolist(), keys], canonical=True)
                prev = self._digest(payload)
                out.append(prev)
            return out
        data = _token_bytes(tokens)
        if not with_extras:
            return self._chain(prev, data)
        header, digest, step = self._token_header, self._digest, 4 * bs
        for i in range(num_full):
            keys = extras.keys_for_block(first_block_index + i, bs)
            # A block without extra keys hashes exactly as if the request had no extras at all.
            tail = _encode_extra_keys(keys) if keys else b""
            prev = digest(prev + header + data[i * step : (i + 1) * step] + tail)
            out.append(prev)
        return out


    def _chain(self, prev: BlockHash, data: bytes) -> list[BlockHash]:
        """The hot path (no extras, not CBOR): the chain after ``prev`` over ``data``, whole blocks of token bytes
        (``_token_bytes``); one concatenation and one digest per block."""
        header, digest, step = self._token_header, self._digest, 4 * self.block_size
        out: list[BlockHash] = []
        for off in range(0, len(data), step):
            prev = digest(prev + header + data[off : off + step])
            out.append(prev)
        return out


class BlockHashMemo:
    """``BlockHasher.hash_blocks`` of whole prompts, memoized by runs of ``run_blocks`` blocks: a prompt that starts
    like an earlier one (the same system prompt, tools or history) takes that prefix's hashes from the memo instead
    of hashing it again, which is most of a router's work per request.

    Exact: a run's hashes depend only on its parent hash and its token bytes, and those (with the hasher's block
    size and algorithm, fixed per memo) are the key; the hashes themselves come from the hasher's own chain
    (``hash_blocks``' hot path, fed the bytes the keys are cut from, so a prompt's tokens are converted once). A
    block starts a run when its index is a multiple of ``run_blocks`` and the run fits in the prompt; the other
    blocks (after the last full run) are memoized one by one (a new question after a shared prompt usually changes
    only the last of them). Before any of that, the blocks a prompt shares with the previous one in the same
    namespace come from that one's hashes, found by comparing token lists (no conversion, no lookups). Bounded:
    least recently used entries are dropped past ``capacity_runs``. One event loop (or thread) per memo.
    """

    def __init__(self, block_size: int, algo: str, capacity_runs: int = 8192, run_blocks: int = 16):
        if capacity_runs < 1 or run_blocks < 1:
            raise ValueError(f"capacity_runs and run_blocks must be >= 1, got {capacity_runs}, {run_blocks}")
        self.block_size = block_size
        self.algo = algo
        self.capacity_runs = capacity_runs
        self.run_blocks = run_blocks
        self._runs: OrderedDict[bytes, list[BlockHash]] = OrderedDict()
        # The previous prompt given as a list: its root, its full blocks' tokens (a copy) and their hashes.
        self._last: tuple[BlockHash, list[int], tuple[BlockHash, ...]] | None = None

    def __len__(self) -> int:
        return len(self._runs)

    def hash_blocks(self, hasher: BlockHasher, token_ids: Sequence[int]) -> list[BlockHash]:
        """``hasher.hash_blocks(token_ids)`` (from the root, no extras); ``hasher`` is any namespace's hasher of
        this memo's block size and algorithm (the root, in the first run's key, keeps namespaces apart)."""
        if hasher.block_size != self.block_size or hasher.algo != self.algo:
            raise ValueError(f"this memo holds {self.algo} hashes of {self.block_size}-token blocks, not "
                             f"{hasher.algo} of {hasher.block_size}")
        bs = self.block_size
        num_full = len(token_ids) // bs
        first, out = self._shared_with_last(hasher.root, token_ids, num_full)
        if first < num_full:
            self._hash_from(hasher, token_ids, first, num_full, out)
        if type(token_ids) is list:
            self._last = (hasher.root, token_ids[: num_full * bs], tuple(out))
        return out

    def _shared_with_last(self, root: BlockHash, token_ids: Sequence[int], num_full: int) -> tuple[int, list]:
        """How many leading full blocks the prompt shares with the previous one (same namespace), and their
        hashes. Lists compare in C, far faster than converting and looking up what they hold."""
        last = self._last
        if last is None or last[0] != root or type(token_ids) is not list:
            return 0, []
        _, tokens, hashes = last
        bs = self.block_size
        lo, hi = 0, min(num_full, len(hashes))  # blocks [0, lo) are shared; [0, hi) is what may be
        final = slice((hi - 1) * bs, hi * bs) if hi else slice(0, 0)
        # Most often only the last blocks differ: the last block first (a short compare), then all before it.
        if token_ids[final] == tokens[final] and token_ids[: hi * bs] == tokens[: hi * bs]:
            return hi, list(hashes[:hi])
        hi -= 1
        while lo < hi:
            if token_ids[lo * bs : hi * bs] == tokens[lo * bs : hi * bs]:
                lo = hi
                break
            mid = (lo + hi) // 2
            if token_ids[lo * bs : mid * bs] == tokens[lo * bs : mid * bs]:
                lo = mid
            hi = mid if lo < mid else hi - 1
        return lo, list(hashes[:lo])

    def _hash_from(self, hasher: BlockHasher, token_ids: Sequence[int], first: int, num_full: int,
                   out: list[BlockHash]) -> None:
        """Appends the hashes of full blocks ``first`` to ``num_full`` to ``out`` (the hashes before them)."""
        bs, run = self.block_size, self.run_blocks
        start = first
        # The token bytes of those blocks, converted once: they key the entries and feed the digests of the blocks
        # not in the memo (CBOR hashes lists of ints, so hash_blocks converts its slice again there).
        data = _token_bytes(_token_array(token_ids[start * bs : num_full * bs]))
        width, runs, cbor = 4 * bs, self._runs, hasher._cbor
        prev = out[-1] if out else hasher.root
        while first < num_full:
            # A key is a parent and the bytes of the blocks after it, so a run's and a block's never mix up.
            count = run if first % run == 0 and first + run <= num_full else 1
            chunk = data[(first - start) * width : (first - start + count) * width]
            key = prev + chunk
            hashes = runs.get(key)
            if hashes is None:
                hashes = runs[key] = (
                    hasher.hash_blocks(token_ids[first * bs : (first + count) * bs], prev, first) if cbor
                    else hasher._chain(prev, chunk))
                if len(runs) > self.capacity_runs:
                    runs.popitem(last=False)
            else:
                runs.move_to_end(key)
            out += hashes
            prev = hashes[-1]
            first += count
