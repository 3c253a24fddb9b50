"""The prefix cache core: block hashing, the block pool, the KV cache manager, events and counters.

Pure Python + numpy; imports no torch, so routers and the planner can use it without a model.
"""

from kvprefix.cache.block_pool import BlockPool
from kvprefix.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher, KVCacheEvent
from kvprefix.cache.free_queue import FreeBlockQueue, KVCacheBlock
from kvprefix.cache.hashing import (
    COLLISION_SAFE_ALGOS,
    HASH_ALGOS,
    BlockExtras,
    BlockHash,
    BlockHasher,
    BlockHashMemo,
    LoraKey,
    MultiModalItem,
    leading_blocks_in,
    prompt_embeds_block_digests,
)
from kvprefix.cache.identity import (
    BlockIdentity,
    ExecutionContext,
    block_identity,
    context_for_checkpoint,
    namespace_id,
    namespace_salt,
)
from kvprefix.cache.manager import KVCacheManager, cdiv
from kvprefix.cache.request import CacheRequest
from kvprefix.cache.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockExtras",
    "BlockHash",
    "BlockHasher",
    "BlockHashMemo",
    "BlockIdentity",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "COLLISION_SAFE_ALGOS",
    "EventPublisher",
    "ExecutionContext",
    "FreeBlockQueue",
    "HASH_ALGOS",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "LoraKey",
    "MultiModalItem",
    "PrefixCacheStats",
    "block_identity",
    "cdiv",
    "context_for_checkpoint",
    "leading_blocks_in",
    "namespace_id",
    "namespace_salt",
    "prompt_embeds_block_digests",
]
