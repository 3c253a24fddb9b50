"""Why a prompt missed the prefix cache: the opt-in per-request diagnosis (docs/server.md, docs/security.md).

``CacheTracker`` mirrors the engine's cache from its KV events and explains a prompt's first uncached block. Every
lookup uses the caller's own salted hashes, whose chain roots in the tenant's salt, so another tenant's cache
contents are unreachable.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvprefix.cache import AllBlocksCleared, BlockHash, BlockHasher, BlockRemoved, BlockStored, KVCacheEvent

_MAX_EVICTED = 65536  # remembered evicted hashes (32 bytes each)


@dataclass
class CacheDetail:
    prompt_index: int
    prompt_tokens: int
    cached_tokens: int
    first_uncached_token: int
    block_size: int
    reason: str  # a stable code: see REASONS
    message: str
    cached_tokens_from: dict[str, int] | None = None  # with a lower tier: {"pool": n, "disk": m}

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["cached_tokens_from"] is None:
            del d["cached_tokens_from"]
        return d


REASONS = {
    "full_hit": "every block before the last prompt token was cached (the last token is always computed)",
    "prompt_shorter_than_block": "prompt shorter than one block",
    "diverged": "diverged at token {n} from the nearest cached prefix",
    "prefix_ended": "the nearest cached prefix ends at token {n}; nothing cached continues it",
    "evicted": "blocks were evicted: the block at token {n} was cached earlier but evicted to make room",
    "different_salt": "different tenant/salt: this prompt is cached in your tenant's namespace without cache_salt",
    "not_cached": "nothing in your tenant/salt cache starts like this prompt",
    "caching_disabled": "prefix caching is disabled on this server",
}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class CacheTracker:
    """A mirror of the engine's cached blocks, fed by its events (which may arrive on the engine's thread)."""

    def __init__(self, hasher: BlockHasher, enabled: bool = True):
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enabled = enabled
        self._lock = threading.Lock()
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._tokens: dict[BlockHash, tuple[int, ...]] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}  # parent (the namespace root for first blocks) -> kids
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()

    # -- event side

    def on_event(self, event: KVCacheEvent) -> None:
        with self._lock:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._drop(h)
                    self._evicted[h] = None
                    self._evicted.move_to_end(h)
                while len(self._evicted) > _MAX_EVICTED:
                    self._evicted.popitem(last=False)
            elif isinstance(event, AllBlocksCleared):
                # After a reset nothing was "evicted"; a miss is then simply not cached.
                self._parent.clear()
                self._tokens.clear()
                self._children.clear()
                self._evicted.clear()

    def _stored(self, event: BlockStored) -> None:
        bs = event.block_size
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * bs : (i + 1) * bs]) if event.token_ids else ()
            self._parent[h] = parent
            self._tokens[h] = tokens
            # A first block's parent is its namespace's root, so siblings are only ever of the same namespace.
            self._children.setdefault(parent, set()).add(h)
            # Kept in _evicted even when stored again: a block that misses was not cached at admission, so if
            # it was ever evicted (since the last reset), eviction is why.
            parent = h

    def _drop(self, h: BlockHash) -> None:
        parent = self._parent.pop(h, None)
        self._tokens.pop(h, None)
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[parent]

    # -- request side

    def hasher_for(self, tenant: str | None, client_salt: str | None, lora: str | None = None) -> BlockHasher:
        """The hasher the engine uses for this namespace (``lora``: the adapter's fingerprint)."""
        return self.hasher.for_namespace(tenant, client_salt, lora)

    def diagnose(
        self,
        prompt_index: int,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        cached_tokens: int,
        tenant: str | None,
        client_salt: str | None,
        lora: str | None = None,
    ) -> CacheDetail:
        bs = self.block_size
        n_tokens = len(token_ids)
        shareable = ((n_tokens - 1) // bs) * bs

        def detail(reason: str, n: int = cached_tokens) -> CacheDetail:
            return CacheDetail(prompt_index, n_tokens, cached_tokens, cached_tokens, bs, reason,
                               REASONS[reason].format(n=n))

        if not self.enabled:
            return detail("caching_disabled")
        if n_tokens < bs:
            return detail("prompt_shorter_than_block")
        if cached_tokens >= shareable:
            return detail("full_hit")
        i = cached_tokens // bs
        own = block_hashes[i]
        with self._lock:
            if own in self._evicted:
                return detail("evicted")
        # The only other namespace looked at is the tenant's unsalted one, which the caller can query directly
        # anyway; other cache_salts may be secrets of other users (docs/security.md). Checked before divergence:
        # every prompt shares the chat template's first tokens, so a first block always "diverges" somewhere.
        if i == 0 and client_salt is not None:
            first = self.hasher_for(tenant, None, lora).hash_blocks(token_ids[:bs])[0]
            if self._is_cached(first):
                return detail("different_salt")
        parent = block_hashes[i - 1] if i else self.hasher_for(tenant, client_salt, lora).root
        block = token_ids[i * bs : (i + 1) * bs]
        with self._lock:
            # Our own block may be cached by now (registered after our prefill): compare with the others only.
            siblings = [self._tokens[h] for h in self._children.get(parent, ()) if h != own and self._tokens.get(h)]
        best = max((_common_prefix(block, s) for s in siblings), default=-1)
        # At block 0, sharing no token with any cached first block is no divergence: nothing starts alike.
        if best > 0 or (i and best == 0):
            return detail("diverged", i * bs + best)
        return detail("prefix_ended" if i else "not_cached")

    def _is_cached(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._tokens
