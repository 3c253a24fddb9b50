"""Block stores below the pool (no torch): one interface (``BlockStore``), the verified object format, the disk
tier, the shared tier on Redis (its client imported when one is opened), the write-behind queue, and what the tiers
hold as KV events for routers (``presence``). The engine's torch side (copying KV in and out) lives in
``engine.kv_tier``."""

from kvprefix.tiers.disk import DiskStore
from kvprefix.tiers.objects import BlockObject, Expected, KVSpec, ObjectError
from kvprefix.tiers.redis_store import RedisStore
from kvprefix.tiers.sizes import parse_size
from kvprefix.tiers.store import BlockStore, TierStats

__all__ = ["BlockObject", "BlockStore", "DiskStore", "Expected", "KVSpec", "ObjectError", "RedisStore", "TierStats", "parse_size"]
